#!/usr/bin/env bash
# One device call: tune the tensor-core skinny-GEMM configs (into the installed table and $OUT), then the online
# sweep on the engine that uses them.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; COMMIT=<sha> bash scripts/device_final_sweep.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TABLE=$(python3 -c "from infer_backend_cuda.kernels import skinny_gemm as S; print(S._TABLE)")
timeout "${TUNE_TIMEOUT:-100}" python3 packages/infer-backend-cuda/scripts/bench_skinny_gemm.py --dot --ops linear \
  --ms 1,2,4,8 --budget-s "${TUNE_BUDGET:-70}" --table "$TABLE" --json "$OUT/skinny_dot_sweep.json" > "$OUT/skinny_dot.log" 2>&1
echo "tune rc=$?"; tail -21 "$OUT/skinny_dot.log"; cp "$TABLE" "$OUT/skinny_gemm.json"
QPS=${QPS:-1,2,4,8,16,32} DURATION=${DURATION:-45} LABEL=${LABEL:-final} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-400} \
  bash "$(dirname "$0")/device_serve_sweep.sh"
