#!/usr/bin/env bash
# One short device call after the fixes of the fourth device session (at most 8 files, straight under $OUT, so a
# cut run still returns what it finished): GPU tests of what changed, the BF16 structured batch (issue 20's B/A)
# and the FP8 chat sweep at qps 32 (issue 15). Each part is bounded.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_wave2_last.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT
export PYTHONUNBUFFERED=1
DURATION=${DURATION:-10}; COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
URL=http://127.0.0.1:8000
source "$(dirname "$0")/device_lib.sh"  # model_dir, engine_up, sweep
stop_engine() { kill -TERM $ENGINE_PID; wait $ENGINE_PID; echo "$1 serve rc=$?"; }
echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)"
DEFAULT_TESTS="tests/gpu/test_logits_processing_cuda.py tests/backend_cuda/test_quant_gemm.py tests/gpu/test_structured_cuda.py"
if [ -n "${TESTS-$DEFAULT_TESTS}" ]; then
  timeout -s INT "${TEST_TIMEOUT:-40}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE ${TESTS-$DEFAULT_TESTS} \
    -k "${TEST_K:-processing or scaled_mm or structured}" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -8
fi
if [ "${BF16:-1}" = 1 ] && engine_up bf16; then
  timeout 60 python3 bench/structured_batch.py --url $URL --model qwen3-4b --repeats 2 --out "$OUT/structured.json" \
    > "$OUT/structured.log" 2>&1; echo "structured rc=$?"; tail -7 "$OUT/structured.log"
  stop_engine bf16
fi
if [ "${FP8:-1}" = 1 ] && engine_up fp8 RUSTINFER_MODEL="$(model_dir qwen3-4b-fp8)"; then
  SWEEP_TIMEOUT=45 sweep fp8_chat "${FP8_QPS:-32}"
  grep -i "scaled_mm\|cublas" "$OUT/serve_fp8.log" | head -3
  stop_engine fp8
fi
