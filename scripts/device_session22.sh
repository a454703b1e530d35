#!/usr/bin/env bash
# The twenty-second session's device calls, each part bounded, the logs packed into $OUT/s22.tar.gz after every part.
#   CALL=first: the GPU's name decides. On an H200 (none since the eighteenth session): CALL=final below first.
#           On any GPU: the prefill attention alone at the ~3,000-token workload's shape (`bench/attention_prefill.py`,
#           a 3,072-token prompt in 512- and 1,024-token chunks) for the default tile and candidates: the 500-token
#           step's prefill attention ran at ~320 TFLOP/s against ~420 for a 16k prompt in one chunk.
#   CALL=final: scripts/device_session21.sh's CALL=final (BF16 chat at qps 1, 8, 32, FP8 at 8, 32) on the committed
#           config. On an H200 the next call is scripts/device_session19.sh's CALL=next (the BF16 mid GEMM tuned at
#           2-128 rows into the installed table, copied into $OUT/s19/mid_gemm.json; replays with it and without).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=first COMMIT=abc1234 bash scripts/device_session22.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, roofline, gpu_tests
session_logs s22

attention_small_chunks() {  # attention_small_chunks TAG CONFIGS...: the prefill attention at the 3k workload's chunks
  timeout 150 python3 bench/attention_prefill.py --tokens 3072 --chunks 512 1024 3072 --configs "$@" \
    > "$LOGS/attention_${1:-x}.log" 2>&1
  echo "attention rc=$?"; tail -40 "$LOGS/attention_${1:-x}.log"; pack
}

case ${CALL:-first} in
  first)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      CALL=final bash "$(dirname "$0")/device_session21.sh"
    fi
    attention_small_chunks default 64,64,4,2 64,64,4,3 64,128,4,2 128,64,8,3 128,128,8,3 64,128,8,2 ;;
  final) CALL=final bash "$(dirname "$0")/device_session21.sh" ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
