#!/usr/bin/env bash
# One device call: start the three processes on the CUDA backend, run the online sweep, stop them.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_serve_sweep.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
QPS=${QPS:-1,4,16}; DURATION=${DURATION:-20}
source "$(dirname "$0")/device_engine.sh"
timeout "${SWEEP_TIMEOUT:-240}" python3 bench/serve_sweep.py --model qwen3-4b --qps "$QPS" --duration "$DURATION" \
  --out "$OUT/serve_sweep.json" 2>&1 | tail -8
python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8000/metrics').text[-1500:])" > "$OUT/metrics.txt" 2>&1
kill -TERM $ENGINE_PID; wait $ENGINE_PID; echo "serve rc=$?"
tail -25 "$OUT/serve.log"
