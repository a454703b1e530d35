#!/usr/bin/env bash
# One device call: the decode roofline with and without programmatic dependent launch, then the GPU tests.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_pdl.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for pdl in 1 0; do
  INFER_CUDA_PDL=$pdl timeout 150 python3 bench/decode_roofline.py --model-dir bench/models/qwen3-4b \
    --batches "${BATCHES:-1,2,4,8,64,256}" --eager-batches "" --out "$OUT/decode_roofline_pdl$pdl.json" 2>&1 | tail -8
done
timeout "${GPU_TESTS_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/backend_cuda \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$?"; grep -E "passed|failed|Error" "$OUT/pytest_gpu.log" | tail -8
