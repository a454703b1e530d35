#!/usr/bin/env bash
# One device call: the online figures of issues 14 and 15 (and 16's when time is left), engines one after another
# on bench/serve_h200.toml with dummy weights. BF16: chat sweep, ~3k-token prompts, one 16k-token prompt alone,
# offline 256 x (512 in, 256 out), structured outputs at batch 64; AWQ and block FP8: the chat sweep at qps 1 and 32;
# Qwen3.5-4B with its vision tower: the chat sweep, the 16k probe, one-image TTFT and a quarter-image sweep.
# Logs and JSON go to $OUT/sweeps.tar.gz (the device returns at most 8 files).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_wave2_sweeps.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/sweeps; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
DURATION=${DURATION:-20}; COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")
URL=http://127.0.0.1:8000
source "$(dirname "$0")/device_lib.sh"  # model_dir, engine_up, engine_down, sweep

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
echo "$COMMIT" > "$LOGS/commit.txt"

# BF16, max_model_len 32k so that the 16k probe fits (the chat shapes are as at 4k: graphs and buckets alike).
engine_up bf16 RUSTINFER_MAX_MODEL_LEN=32768
sweep bf16_chat "${BF16_QPS:-1,8,32}"
sweep bf16_long 4 --workload long
ttft_16k bf16
timeout 120 python3 bench/offline_throughput.py --url $URL --model qwen3-4b --num-seqs 256 --input-len 512 \
  --output-len 256 --out "$LOGS/offline.json" > "$LOGS/offline.log" 2>&1; echo "offline rc=$?"; tail -4 "$LOGS/offline.log"
if [ -f bench/structured_batch.py ]; then
  timeout 150 python3 bench/structured_batch.py --url $URL --model qwen3-4b --out "$LOGS/structured.json" \
    > "$LOGS/structured.log" 2>&1; echo "structured rc=$?"; tail -12 "$LOGS/structured.log"
fi
engine_down bf16
if [ "${BF16_4K:-1}" = 1 ]; then  # the same engine at the default 4k context: does the 32k block table cost offline / qps 32?
  engine_up bf16_4k
  timeout 120 python3 bench/offline_throughput.py --url $URL --model qwen3-4b --num-seqs 256 --input-len 512 \
    --output-len 256 --out "$LOGS/offline_4k.json" > "$LOGS/offline_4k.log" 2>&1; echo "offline 4k rc=$?"; tail -4 "$LOGS/offline_4k.log"
  sweep bf16_4k_chat 32
  engine_down bf16_4k
fi

for q in ${QUANT_FORMATS:-awq fp8}; do
  engine_up $q RUSTINFER_MODEL="$(model_dir qwen3-4b-$q)"
  sweep ${q}_chat 1,32
  engine_down $q
done

if [ "${QWEN35:-1}" = 1 ]; then  # Qwen3.5-4B with its vision tower (bench/models/qwen3.5-4b-vl/README.md)
  dir=$(model_dir qwen3.5-4b-vl); cp bench/models/qwen3.5-4b-vl/{preprocessor_config.json,chat_template.jinja} "$dir/"
  engine_up qwen35 RUSTINFER_MODEL="$dir" RUSTINFER_MAX_MODEL_LEN=32768
  sweep qwen35_chat "${QWEN35_QPS:-1,8,32}"
  ttft_16k qwen35
  timeout 90 python3 bench/serve_sweep.py --url $URL --model qwen3-4b --image-ttft 5 --image-side 1024 \
    --max-tokens 8 --commit "$COMMIT" --out "$LOGS/image_ttft.json" > "$LOGS/image_ttft.log" 2>&1
  echo "image ttft rc=$?"; tail -2 "$LOGS/image_ttft.log"
  sweep qwen35_images "${IMAGE_QPS:-4}" --image-fraction 0.25 --image-side 1024
  engine_down qwen35
fi
tar -czf "$OUT/sweeps.tar.gz" -C "$OUT" sweeps && rm -rf "$LOGS"
