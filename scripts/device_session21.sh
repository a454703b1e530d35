#!/usr/bin/env bash
# The twenty-first session's device calls, each part bounded, the logs packed into $OUT/s21.tar.gz after every part.
#   CALL=ttft: BF16 decode replays at 1, 2 and 4 rows (context 400; on an H100 the skinny table's new H100 entries),
#           then BF16 chat at qps LEVELS (1,8,32) with per-request timelines (`serve_sweep.py --timeline`): the client
#           TTFT p99 against the server's TTFT histogram, after the tokenizer tables moved to asset loading.
#   CALL=cap: BF16 chat at qps CAP_LEVELS (8,32) with timelines on engines whose prefill_tokens_while_decoding is each of
#           CAPS (0 64 128): at qps 32 most gaps above twice the median are mixed steps; with no cap two ~137-token
#           prompts can share a step beside ~85 decodes (the 512-token graph), with a cap of 128-192 a step carries one.
#   CALL=final: chat on bench/serve_h200.toml as committed (its prefill cap included): BF16 at qps BF16_LEVELS (1,8,32),
#           then FP8 (qwen3-4b-fp8 dummy) at qps FP8_LEVELS (8,32): issue 15's FP8-against-BF16 ITL p50 at qps 32.
#   CALL=wgmma (c5c7170, removed with the kernel after calls 7 and 8): the Gluon block-FP8 GEMM's GPU tests and
#           bench_fp8_wgmma.py; docs/benchmarks.md, twenty-first session.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=ttft COMMIT=abc1234 bash scripts/device_session21.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, roofline
session_logs s21

case ${CALL:-ttft} in
  ttft)
    ROOFLINE_TIMEOUT=100 ROOFLINE_ARGS="--context 400" roofline replays qwen3-4b 1,2,4
    if engine_up bf16 RUSTINFER_MAX_MODEL_LEN=32768; then
      sweep bf16_chat "${LEVELS:-1,8,32}" --timeline
      grep "warm-up" "$LOGS/sweep_bf16_chat.log"
      engine_down bf16; pack
      grep -E "time_to_first_token_seconds_bucket\{le=\"0.(04|06|1|25)\"|time_to_first_token_seconds_count" \
        "$LOGS/metrics_bf16.txt"
    fi ;;
  cap)
    for cap in ${CAPS:-0 64 128}; do
      engine_up "cap$cap" RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PREFILL_TOKENS_WHILE_DECODING=$cap || continue
      sweep "cap${cap}_chat" "${CAP_LEVELS:-8,32}" --timeline
      engine_down "cap$cap"; pack
    done ;;
  final)
    for run in "bf16:qwen3-4b:${BF16_LEVELS:-1,8,32}" "fp8:qwen3-4b-fp8:${FP8_LEVELS:-8,32}"; do
      IFS=: read -r fmt model levels <<< "$run"
      engine_up "$fmt" RUSTINFER_MODEL="$(model_dir "$model")" RUSTINFER_MAX_MODEL_LEN=32768 || continue
      sweep "${fmt}_chat" "$levels"
      engine_down "$fmt"; pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
