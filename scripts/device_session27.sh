#!/usr/bin/env bash
# The twenty-seventh session's device calls, each part bounded, the logs packed into $OUT/s27.tar.gz after every part.
#   CALL=mixed: what a chat prompt's chunk costs beside ~96 decodes (bench/mixed_step.py at the chat shape: 96 decodes
#           at 400 tokens of context, padded to the 128-row decode graph, and chunks of 32 / 96 / 160 tokens in the
#           128- and 256-token mixed graphs), kernels ranked at chunks 0 and 160. The chat ITL p99 at qps 32 is a mixed
#           step; predicted: ~+1 ms at 160 tokens (the GEMMs at 256 rows past the weight stream), ~0 at 32 (same rows).
#   CALL=buckets: chat at qps 32 (DURATION s) on three engines: the served config; finer mixed-graph token buckets
#           (BUCKETS); those buckets with a 96-token prefill cap. A chat prompt beside ~96 decodes pads its mixed step to
#           the 256-token graph: at 192 rows the GEMMs are still near the weight stream, at 256 past the ridge
#           (~3.2 ms against ~2.4 on the H200). Predicted: ITL p99 -0.5 to -0.8 ms with both, p50 unchanged.
#   CALL=streams: the mixed step's prefill attention on a side stream (INFER_CUDA_MIXED_ATTENTION_STREAMS): its GPU
#           test, then the chat-shape mixed step (CALL=mixed's, unprofiled) with the switch off and on. The mixed
#           128-token graph took 8.35 ms against the 128-row decode graph's 6.94 (H100): the prefill attention of a
#           32-token chunk ran after the decode attention, ~20 us a layer of few programs. Predicted: most of that
#           hidden under the decode attention, -0.4 to -0.7 ms a mixed step. SPECS (default "pdl0 streams0 streams1"):
#           pdl0 also launches the prefill attention without PDL (28th: predicted -0.05 to -0.15 ms a mixed step with);
#           streams2 also moves the chunk rows' q/k store to the side stream and the one-token rows' into the decode
#           launch (28th: the main stream then runs a decode step's chain; predicted another -0.1 to -0.2 ms).
#           A "b4" suffix bounds the mixed graphs' prefill grid to 4 prompt chunks (mixed_graph_chunk_seqs): the 128-token
#           graph's 1,056 programs of one an SM (164 KB of shared memory each), ~20 us a layer of programs that
#           return at once, become 64; predicted -0.4 to -0.6 ms a mixed step (and a prerequisite of the streams:
#           otherwise the returning programs hold whole SMs beside the decode attention).
#   CALL=streams_served: chat at qps LEVELS (DURATION s) on the served config, with the prefill grid bounded to 4 prompt
#           chunks (b4), and with that and the mixed step split by rows (streams2b4); SERVED_SPECS picks others.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=mixed COMMIT=abc1234 bash scripts/device_session27.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, pack
session_logs s27

case ${CALL:-mixed} in
  mixed)
    timeout 240 python3 bench/mixed_step.py --model-dir bench/models/qwen3-4b --decodes "${DECODES:-96}" \
      --context 400 --prompt 192 --chunks 0,32,96,160 --capture-tokens 64,128,256,512 --steps 20 --profile 0,32,160 \
      --out "$LOGS/mixed_chat.json" > "$LOGS/mixed_chat.log" 2>&1
    echo "mixed_step rc=$?"; grep -A6 "^ *chunk *tokens" "$LOGS/mixed_chat.log"
    grep -A12 "^chunk .*kernels" "$LOGS/mixed_chat.log" | cut -c1-110 ;;
  buckets)
    buckets=${BUCKETS:-[64,128,160,192,224,256,320,384,512,1024,2048]}
    for spec in "base" "fine" "fine96"; do
      extra=()
      case $spec in
        fine) extra=("RUSTINFER_CAPTURE_TOKENS=$buckets") ;;
        fine96) extra=("RUSTINFER_CAPTURE_TOKENS=$buckets" RUSTINFER_PREFILL_TOKENS_WHILE_DECODING=96) ;;
      esac
      engine_up "$spec" RUSTINFER_MAX_MODEL_LEN=32768 "${extra[@]}" || continue
      grep -h "mixed steps of up to" "$LOGS/serve_$spec.log" | cut -c1-160
      sweep "${spec}_chat" "${LEVELS:-32}"
      engine_down "$spec"; pack
    done ;;
  streams)
    [ "${TEST_S:-120}" -gt 0 ] && gpu_tests streams "${TEST_S:-120}" tests/backend_cuda/test_attention.py tests/backend_cuda/test_attention_prefill_ws.py \
      tests/backend_cuda/test_mixed_rope_attention.py tests/backend_cuda/test_qk_norm_rope.py \
      -k "two_streams or mixed or port or ws or pdl or rope"
    for spec in ${SPECS:-pdl0 streams0 streams0b4 streams1b4 streams2b4}; do  # pdl0: the prefill attention without PDL (before 28th), one stream
      pdl=1; bound=0; on=${spec#streams}; on=${on%%b*}; [ "$spec" = pdl0 ] && { pdl=0; on=0; }
      case $spec in *b4) bound=4 ;; esac  # streamsNb4: the mixed graphs' prefill grid bound to 4 prompt chunks
      INFER_CUDA_WS_PREFILL_PDL=$pdl INFER_CUDA_MIXED_ATTENTION_STREAMS=$on timeout "${RUN_S:-150}" python3 bench/mixed_step.py \
        --model-dir bench/models/qwen3-4b --decodes 96 --context 400 --prompt 192 --chunks "${CHUNKS:-0,32,96,160}" \
        --chunk-seqs $bound \
        --capture-tokens 64,128,256,512 --steps "${STEPS:-20}" --out "$LOGS/$spec.json" > "$LOGS/$spec.log" 2>&1
      echo "mixed_step $spec rc=$?"; grep -A6 "^ *chunk *tokens" "$LOGS/$spec.log"; pack
    done ;;
  streams_served)
    for spec in ${SERVED_SPECS:-base b4 streams2b4}; do  # b4: mixed_graph_chunk_seqs = 4; streamsN: the switch at N
      extra=()
      case $spec in *b4) extra+=(RUSTINFER_MIXED_GRAPH_CHUNK_SEQS=4) ;; esac
      case $spec in streams*) on=${spec#streams}; extra+=("INFER_CUDA_MIXED_ATTENTION_STREAMS=${on%%b*}") ;; esac
      engine_up "$spec" RUSTINFER_MAX_MODEL_LEN=32768 "${extra[@]}" || continue
      sweep "${spec}_chat" "${LEVELS:-32}"
      engine_down "$spec"; pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
