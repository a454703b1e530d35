#!/usr/bin/env bash
# Sourced by the device scripts: start the CUDA engine on $ENGINE_CONFIG (default bench/serve_h200.toml; RUSTINFER_*
# variables override its fields) and wait until /ready. Sets ENGINE_PID; logs to $SERVE_LOG (default $OUT/serve.log).
SERVE_LOG=${SERVE_LOG:-$OUT/serve.log}
python3 -c "from rustinfer.launcher import main; main()" serve --config "${ENGINE_CONFIG:-bench/serve_h200.toml}" \
  > "$SERVE_LOG" 2>&1 &
ENGINE_PID=$!
# Waits until /ready, or until the engine's launcher exits (a failed start-up costs seconds of device time, not
# the whole wait): ENGINE_UP=1 when it serves.
ENGINE_UP=0
PORT=${PORT:-8000} ENGINE_PID=$ENGINE_PID python3 - <<'PY' && ENGINE_UP=1
import os, sys, time, httpx
pid = int(os.environ["ENGINE_PID"])
for _ in range(240):
    try:
        if httpx.get(f"http://127.0.0.1:{os.environ['PORT']}/ready", timeout=2).status_code == 200:
            print("ready"); sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        print("the engine exited during start-up"); sys.exit(1)
    time.sleep(1)
print("not ready after 240 s"); sys.exit(1)
PY
[ "$ENGINE_UP" = 1 ] || tail -5 "$SERVE_LOG"
