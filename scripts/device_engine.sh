#!/usr/bin/env bash
# Sourced by the device scripts: start the CUDA engine on $ENGINE_CONFIG (default bench/serve_h200.toml; RUSTINFER_*
# variables override its fields) and wait until /ready. Sets ENGINE_PID; logs to $SERVE_LOG (default $OUT/serve.log).
SERVE_LOG=${SERVE_LOG:-$OUT/serve.log}
python3 -c "from rustinfer.launcher import main; main()" serve --config "${ENGINE_CONFIG:-bench/serve_h200.toml}" \
  > "$SERVE_LOG" 2>&1 &
ENGINE_PID=$!
PORT=${PORT:-8000} python3 - <<'PY'
import os, time, httpx
for _ in range(240):
    try:
        if httpx.get(f"http://127.0.0.1:{os.environ['PORT']}/ready", timeout=2).status_code == 200:
            print("ready"); break
    except httpx.HTTPError:
        pass
    time.sleep(1)
PY
