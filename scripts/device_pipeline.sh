#!/usr/bin/env bash
# One device call after a pipeline change: the GPU test suite, then the offline workloads.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_pipeline.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/gpu tests/backend_cuda \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$?"; tail -4 "$OUT/pytest_gpu.log"
bash "$(dirname "$0")/device_offline.sh"
