#!/usr/bin/env bash
# One device call: try weight prefetch in the skinny GEMM (tuned into the installed table when it wins alone),
# the GPU tests with the tuned table, then the decode roofline with the tuned table and with the committed one
# (the in-model A/B decides what to commit).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_prefetch.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TABLE=$(python3 -c "from infer_backend_cuda.kernels import skinny_gemm as S; print(S._TABLE)")
cp "$TABLE" "$OUT/skinny_gemm_committed.json"
timeout "${TUNE_TIMEOUT:-150}" python3 packages/infer-backend-cuda/scripts/bench_skinny_gemm.py --prefetch --ops linear \
  --ms 1,2,4,8 --budget-s "${TUNE_BUDGET:-120}" --table "$TABLE" --json "$OUT/skinny_prefetch_sweep.json" > "$OUT/skinny_prefetch.log" 2>&1
echo "tune rc=$?"; tail -21 "$OUT/skinny_prefetch.log"; cp "$TABLE" "$OUT/skinny_gemm.json"
if [ "${GPU_TESTS:-1}" = 1 ]; then  # the tuned table in the model: graph == eager, CUDA == CPU, kernels
  timeout "${GPU_TESTS_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu \
    tests/backend_cuda/test_skinny_gemm.py > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu rc=$?"; grep -E "passed|failed|Error" "$OUT/pytest_gpu.log" | tail -4
fi
for table in tuned committed; do
  [ "$table" = committed ] && cp "$OUT/skinny_gemm_committed.json" "$TABLE"
  timeout 150 python3 bench/decode_roofline.py --model-dir bench/models/qwen3-4b --batches "${BATCHES:-1,2,4,8,64}" \
    --eager-batches "" --out "$OUT/decode_roofline_$table.json" 2>&1 | tail -6
done
