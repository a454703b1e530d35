#!/usr/bin/env bash
# One device call for the decode GEMMs: the GPU test suite, the skinny-GEMM tuning sweep (its table is written
# into the installed package, so the runs after it use it, and to $OUT for committing), then the decode
# roofline with cuBLAS only and with the skinny GEMM. TUNE_MODEL=qwen3.5-4b tunes and measures that model's shapes.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_skinny.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/backend_cuda \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu rc=$?"; grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -8
fi
TABLE=$(python3 -c "from infer_backend_cuda.kernels import skinny_gemm as S; print(S._TABLE)")
mkdir -p "$(dirname "$TABLE")"
timeout "${TUNE_TIMEOUT:-260}" python3 packages/infer-backend-cuda/scripts/bench_skinny_gemm.py \
  --model "${TUNE_MODEL:-qwen3-4b}" --ops "${TUNE_OPS:-linear,add_rms_norm_linear}" --ms "${TUNE_MS:-1,2,4,8}" --budget-s "${TUNE_BUDGET:-200}" --table "$TABLE" --json "$OUT/skinny_gemm_sweep.json" > "$OUT/skinny_tune.log" 2>&1
echo "tune rc=$?"; tail -22 "$OUT/skinny_tune.log"; cp "$TABLE" "$OUT/skinny_gemm.json"
for skinny in ${SKINNY_AB:-0 1}; do
  INFER_CUDA_SKINNY_GEMM=$skinny timeout 150 python3 bench/decode_roofline.py --model-dir "bench/models/${TUNE_MODEL:-qwen3-4b}" \
    --batches "${BATCHES:-1,2,4,8,64}" --eager-batches "" --out "$OUT/decode_roofline_skinny$skinny.json" 2>&1 | tail -7
done
