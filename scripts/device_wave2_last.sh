#!/usr/bin/env bash
# One short device call after the fixes of the fourth device session: the GPU tests of what changed (fp32 prefill
# tiles, the quantized GEMMs, the GDN kernels), the quantized GEMMs per decode shape, one GDN layer, the AWQ decode
# roofline and the served step by kind of row (structured outputs). Each part bounded; logs to $OUT/last.tar.gz.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_wave2_last.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/last; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "$COMMIT" | tee "$LOGS/commit.txt"; nvidia-smi --query-gpu=name --format=csv,noheader | tee "$LOGS/gpu.txt"
SCRIPTS=packages/infer-backend-cuda/scripts
run() {  # run LABEL SECONDS CMD...: bounded, logged, its tail shown
  local label=$1 secs=$2; shift 2
  timeout -s INT "$secs" "$@" > "$LOGS/$label.log" 2>&1; echo "$label rc=$?"; tail -"${TAIL:-14}" "$LOGS/$label.log"
}
TAIL=12 run pytest_gpu "${TEST_TIMEOUT:-90}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
  tests/backend_cuda/test_attention.py -k "prefill_large and case0 or prefill_large and case1 or quant or gdn or gated" \
  ${EXTRA_TESTS:-tests/backend_cuda/test_quant_gemm.py tests/backend_cuda/test_gated_delta.py}
run quant_awq 50 python3 $SCRIPTS/bench_quant_gemm.py --formats awq --ms 1,8 --budget-s 40 --json "$LOGS/quant_awq.json"
run quant_fp8 50 python3 $SCRIPTS/bench_quant_gemm.py --formats fp8 --ms 128,256,2048 --budget-s 40 --json "$LOGS/quant_fp8.json"
run bench_gdn 45 python3 $SCRIPTS/bench_gdn.py
TAIL=4 run roofline_awq 45 python3 bench/decode_roofline.py --model-dir bench/models/qwen3-4b-awq --batches 1,32 \
  --eager-batches "" --steps 20 --out "$LOGS/roofline_awq.json"
TAIL=8 run structured_step 75 python3 bench/structured_step.py --model-dir bench/models/qwen3-4b \
  --tokenizer-dir .bench-models/qwen3-4b-dummy --out "$LOGS/structured_step.json"
tar -czf "$OUT/last.tar.gz" -C "$OUT" last && rm -rf "$LOGS"
