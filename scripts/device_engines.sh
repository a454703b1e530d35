#!/usr/bin/env bash
# One device call over several engines, each with the parts named for it:
#   ENGINES="bf16:structured+offline fp8:chat=1,8,32 awq:chat=1,8,32 qwen35:chat=32+16k"
# An engine may carry config overrides: "bf16@PREFILL_TOKENS_WHILE_DECODING=512:long=4" (RUSTINFER_<FIELD>; several
# joined by commas); its logs are then labelled bf16_PREFILL_TOKENS_WHILE_DECODING_512.
# Parts: chat=QPS (the chat sweep), long=QPS (~3k-token prompts), 16k (one 16k prompt alone, median of 5),
# structured (batch 64, a quarter under a JSON schema), offline (256 x (512 in, 256 out)).
# Engines: bf16, awq, fp8 (Qwen3-4B shapes), qwen35 (Qwen3.5-4B with its vision tower). Each part is bounded.
# The logs are packed into $OUT/engines.tar.gz after every engine, so a cut run still returns what finished.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; ENGINES=... bash scripts/device_engines.sh
# COMMIT: name the tree from the machine that holds it (COMMIT=abc1234 ...): the device's copy of .git can be older
# than the tree it runs (seen 2026-12-02: every call printed the session's first commit).
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/engines; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
DURATION=${DURATION:-15}; COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
URL=http://127.0.0.1:8000
source "$(dirname "$0")/device_lib.sh"  # model_dir, engine_up, engine_down, sweep, ttft_16k
echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$LOGS/commit.txt"

start() {  # start ENGINE TAG [RUSTINFER_X=... ...]: the engine's checkpoint and overrides
  local engine=$1 tag=$2; shift 2
  case $engine in
    bf16) engine_up "$tag" RUSTINFER_MAX_MODEL_LEN=32768 "$@" ;;
    awq|fp8) engine_up "$tag" RUSTINFER_MODEL="$(model_dir "qwen3-4b-$engine")" RUSTINFER_MAX_MODEL_LEN=32768 "$@" ;;
    qwen35)
      local dir; dir=$(model_dir qwen3.5-4b-vl)
      cp bench/models/qwen3.5-4b-vl/{preprocessor_config.json,chat_template.jinja} "$dir/"
      engine_up "$tag" RUSTINFER_MODEL="$dir" RUSTINFER_MAX_MODEL_LEN=32768 "$@" ;;
    *) echo "unknown engine $1"; return 1 ;;
  esac
}

for spec in ${ENGINES:-bf16:structured}; do
  head=${spec%%:*}; engine=${head%%@*}; overrides=()
  if [ "$head" != "$engine" ]; then
    IFS=, read -r -a fields <<< "${head#*@}"
    for f in "${fields[@]}"; do overrides+=("RUSTINFER_$f"); done
  fi
  label=$(echo "$head" | tr '@=,' '___')
  start "$engine" "$label" "${overrides[@]}" || continue
  IFS=+ read -r -a parts <<< "${spec#*:}"
  for part in "${parts[@]}"; do
    case $part in
      chat=*) sweep "${label}_chat" "${part#chat=}" ;;
      long=*) sweep "${label}_long" "${part#long=}" --workload long ;;
      16k) ttft_16k "$label" ;;
      structured)
        timeout 180 python3 bench/structured_batch.py --url $URL --model qwen3-4b --repeats 3 --clients 8 \
          --out "$LOGS/structured_$label.json" > "$LOGS/structured_$label.log" 2>&1
        echo "structured $label rc=$?"; tail -7 "$LOGS/structured_$label.log" ;;
      offline)
        timeout 90 python3 bench/offline_throughput.py --url $URL --model qwen3-4b --num-seqs 256 --input-len 512 \
          --output-len 256 --vocab 150000 --out "$LOGS/offline_$label.json" > "$LOGS/offline_$label.log" 2>&1
        echo "offline $label rc=$?"; tail -4 "$LOGS/offline_$label.log" ;;
      *) echo "unknown part $part" ;;
    esac
  done
  engine_down "$label"
  tar -czf "$OUT/engines.tar.gz" -C "$OUT" engines
done
tar -czf "$OUT/engines.tar.gz" -C "$OUT" engines && rm -rf "$LOGS"
