#!/usr/bin/env bash
# One device call (see shared/DEVICE.md): decode roofline bench, then the GPU test suite. Logs and JSON go to $OUT.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_gpu_check.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${BENCH_TIMEOUT:-240}" python3 bench/decode_roofline.py --out "$OUT/decode_roofline.json" \
  > "$OUT/decode_roofline.log" 2>&1; echo "bench rc=$?" | tee -a "$OUT/decode_roofline.log"
tail -12 "$OUT/decode_roofline.log"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/backend_cuda \
  > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?" | tee -a "$OUT/pytest_gpu.log"
tail -15 "$OUT/pytest_gpu.log"
