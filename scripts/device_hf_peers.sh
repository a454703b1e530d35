#!/usr/bin/env bash
# One device call: the HF transformers peers on the workloads of bench/offline_throughput.py and
# bench/serve_sweep.py (written 2026-11-30 and not run yet: the session's device time was spent).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_hf_peers.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL_DIR=.bench-models/qwen3-4b-dummy
timeout 300 python3 bench/hf_generate_batch.py --model-dir "$MODEL_DIR" --num-seqs 256 --input-len 512 \
  --output-len 256 --out "$OUT/hf_generate_batch.json" | tail -12
# transformers serve loads weights from disk: save a random-weight copy first (~8 GB).
RANDOM_DIR=/tmp/qwen3-4b-random
python3 - "$MODEL_DIR" "$RANDOM_DIR" <<'PY'
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(dst)
for f in src.iterdir():
    if f.name.startswith(("tokenizer", "generation_config")):
        shutil.copy(f, dst / f.name)
print("saved", dst)
PY
transformers serve "$RANDOM_DIR" --continuous-batching --port 8001 --dtype bfloat16 > "$OUT/hf_serve.log" 2>&1 &
HF_PID=$!
python3 - <<'PY'
import time, httpx
for _ in range(300):
    try:
        if httpx.get("http://127.0.0.1:8001/health", timeout=2).status_code == 200:
            print("hf serve ready"); break
    except httpx.HTTPError:
        pass
    time.sleep(1)
PY
timeout 200 python3 bench/serve_sweep.py --url http://127.0.0.1:8001 --model "$RANDOM_DIR" --qps 1,2 --duration 30 \
  --no-ignore-eos --label hf-transformers-serve --out "$OUT/serve_sweep_hf.json" 2>&1 | tail -4
kill $HF_PID; wait $HF_PID 2>/dev/null
tail -5 "$OUT/hf_serve.log"
