#!/usr/bin/env bash
# One device call: the image measurements of issue 17 on a Qwen3.5-4B-shaped dummy model with its vision tower.
# The model directory is assembled in /tmp: the carried Qwen3 tokenizer folder (.bench-models/qwen3-4b-dummy) with
# bench/models/qwen3.5-4b-vl's config.json, preprocessor_config.json and chat_template.jinja on top (that folder's
# README says why the image token ids are the Qwen3 tokenizer's). Then
#   (a) the vision tower's GPU time per image (bench/vision_tower.py, before the engine takes the GPU),
#   (b) the TTFT of one 1024x1024 image plus a short question, median of 5, one request at a time,
#   (c) the mixed text-and-image chat sweep (a quarter of the requests carry a 1024x1024 image).
# Everything lands in $OUT/images.tar.gz (the device returns at most 8 files).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_images.sh
# Knobs: VL_CONFIG (the config folder), BASE_MODEL (the tokenizer folder), TOWER=0 skips (a), IMAGE_SIDE, QPS,
# DURATION, PORT, *_TIMEOUT, and RUSTINFER_* overrides of bench/serve_h200.toml (e.g. RUSTINFER_BACKEND=cpu for a dry run).
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
VL_CONFIG=${VL_CONFIG:-bench/models/qwen3.5-4b-vl}; BASE_MODEL=${BASE_MODEL:-.bench-models/qwen3-4b-dummy}
IMAGE_SIDE=${IMAGE_SIDE:-1024}; QPS=${QPS:-1,4}; DURATION=${DURATION:-20}
git rev-parse --short HEAD 2>/dev/null | tee "$LOGS/commit.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$LOGS/gpu.txt"

MODEL_DIR=$(mktemp -d /tmp/qwen3.5-4b-vl.XXXXXX)
cp -r "$BASE_MODEL"/. "$MODEL_DIR"/
cp "$VL_CONFIG"/config.json "$VL_CONFIG"/preprocessor_config.json "$VL_CONFIG"/chat_template.jinja "$MODEL_DIR"/

if [ "${TOWER:-1}" = 1 ]; then
  timeout "${TOWER_TIMEOUT:-120}" python3 bench/vision_tower.py --sizes 448,1024 > "$LOGS/vision_tower.log" 2>&1
  echo "vision_tower rc=$?"; tail -3 "$LOGS/vision_tower.log"
fi

PORT=${PORT:-8000}; URL=http://127.0.0.1:$PORT
export RUSTINFER_MODEL=$MODEL_DIR RUSTINFER_MODEL_NAME=qwen3.5-4b RUSTINFER_PORT=$PORT
SERVE_LOG=$LOGS/serve.log
source "$(dirname "$0")/device_engine.sh"

timeout "${TTFT_TIMEOUT:-120}" python3 bench/serve_sweep.py --url "$URL" --model qwen3.5-4b --image-ttft 5 \
  --image-side "$IMAGE_SIDE" --max-tokens 8 --commit "${COMMIT:-}" --out "$LOGS/image_ttft.json" \
  > "$LOGS/image_ttft.log" 2>&1
echo "image ttft rc=$?"; tail -3 "$LOGS/image_ttft.log"

timeout "${SWEEP_TIMEOUT:-300}" python3 bench/serve_sweep.py --url "$URL" --model qwen3.5-4b --image-fraction 0.25 \
  --image-side "$IMAGE_SIDE" --qps "$QPS" --duration "$DURATION" --label images --commit "${COMMIT:-}" \
  --clients "${CLIENTS:-4}" --out "$LOGS/serve_sweep_images.json" > "$LOGS/serve_sweep_images.log" 2>&1
echo "sweep rc=$?"; tail -8 "$LOGS/serve_sweep_images.log"

python3 -c "import httpx; print(httpx.get('$URL/metrics').text[-3000:])" > "$LOGS/metrics.txt" 2>&1
kill -TERM "$ENGINE_PID"; wait "$ENGINE_PID"; echo "serve rc=$?"
tail -5 "$LOGS/serve.log"
rm -rf "$MODEL_DIR"
tar -czf "$OUT/images.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
