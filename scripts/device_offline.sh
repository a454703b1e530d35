#!/usr/bin/env bash
# One device call: start the CUDA engine, run the offline workloads, stop it.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_offline.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "from rustinfer.launcher import main; main()" serve --config bench/serve_h200.toml > "$OUT/serve.log" 2>&1 &
pid=$!
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
timeout 100 python3 bench/offline_throughput.py --model qwen3-4b --input-len 512 --output-len 256 \
  --out "$OUT/offline_512_256.json" | tail -4
timeout 100 python3 bench/offline_throughput.py --model qwen3-4b --out "$OUT/offline_nanovllm.json" | tail -4
kill -TERM $pid; wait $pid; echo "serve rc=$?"
