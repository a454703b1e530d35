#!/usr/bin/env bash
# The twenty-sixth session's device calls, each part bounded, the logs packed into $OUT/s26.tar.gz after every part.
#   (call 3 ran scripts/device_session25.sh's CALL=pingpong, removed with the variant after the session)
#   CALL=served: the ~3,000-token prompts at qps 4 with the warp-specialised prefill attention (the default), prefill
#           caps 512 and 1,024 (graph-fitted chunks), then one 16k-token prompt's TTFT alone (median of 5).
#   CALL=pace: paced plans (plan_slack_ms, for each of SLACKS, default "0 1"): the ~3,000-token prompts at qps 4 with
#           the 512-token cap (PACE_LONG=0: not), then chat at qps 1 and 32 on the served config; the pacing counters
#           from /metrics.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=served COMMIT=abc1234 bash scripts/device_session26.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, ttft_16k
session_logs s26

case ${CALL:-served} in
  served)
    for cap in 512 1024; do
      engine_up "ws_cap$cap" RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PREFILL_TOKENS_WHILE_DECODING=$cap || continue
      sweep "ws_cap${cap}_long" 4 --workload long
      [ "$cap" = 1024 ] && ttft_16k ws
      engine_down "ws_cap$cap"; pack
    done ;;
  pace)  # plans held until shortly before the running step ends (plan_slack_ms) against unpaced, per SLACKS
    for slack in ${SLACKS:-0 1}; do
      [ "${PACE_LONG:-1}" = 1 ] && engine_up "pace${slack}_cap512" RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PREFILL_TOKENS_WHILE_DECODING=512 \
        RUSTINFER_PLAN_SLACK_MS=$slack && {
        sweep "pace${slack}_long" 4 --workload long
        engine_down "pace${slack}_cap512"; grep -h "plans_held" "$LOGS/metrics_pace${slack}_cap512.txt" | grep -v "^#"; }
      engine_up "pace${slack}_chat" RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PLAN_SLACK_MS=$slack || continue
      sweep "pace${slack}_chat" 1,32
      engine_down "pace${slack}_chat"; grep -h "plans_held" "$LOGS/metrics_pace${slack}_chat.txt" | grep -v "^#"
      pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
