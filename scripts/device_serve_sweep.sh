#!/usr/bin/env bash
# One device call: start the three processes on the CUDA backend, run the online sweep, stop them.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_serve_sweep.sh
# QPS, DURATION (s per level), LABEL and any RUSTINFER_* override (e.g. RUSTINFER_ENABLE_OVERLAP=false) apply.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
QPS=${QPS:-1,2,4,8,16,32}; DURATION=${DURATION:-60}; LABEL=${LABEL:-rustinfer}
source "$(dirname "$0")/device_engine.sh"
timeout "${SWEEP_TIMEOUT:-500}" python3 bench/serve_sweep.py --model qwen3-4b --qps "$QPS" --duration "$DURATION" \
  --label "$LABEL" --commit "${COMMIT:-}" --host-budget --clients "${CLIENTS:-4}" --out "$OUT/serve_sweep_$LABEL.json" 2>&1 | tail -14
python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8000/metrics').text[-1500:])" > "$OUT/metrics_$LABEL.txt" 2>&1
kill -TERM $ENGINE_PID; wait $ENGINE_PID; echo "serve rc=$?"
tail -5 "$OUT/serve.log"
