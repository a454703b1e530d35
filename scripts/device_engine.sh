#!/usr/bin/env bash
# Sourced by the device scripts: start the CUDA engine on bench/serve_h200.toml and wait until /ready.
# Sets ENGINE_PID; logs to $OUT/serve.log.
python3 -c "from rustinfer.launcher import main; main()" serve --config bench/serve_h200.toml > "$OUT/serve.log" 2>&1 &
ENGINE_PID=$!
python3 - <<'PY'
import time, httpx
for _ in range(240):
    try:
        if httpx.get("http://127.0.0.1:8000/ready", timeout=2).status_code == 200:
            print("ready"); break
    except httpx.HTTPError:
        pass
    time.sleep(1)
PY
