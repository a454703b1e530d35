#!/usr/bin/env bash
# The twenty-ninth session's device calls, each part bounded, the logs packed into $OUT/s29.tar.gz after every part.
#   CALL=decode: the decode attention's grid order and page layout (bench_decode_splits.py --variants, served form):
#           a page holds its tokens' KV heads interleaved, so a program reads 256 B pieces at a 2 KB stride, and with
#           the sequences fastest in the grid the other heads' programs read the rest of those DRAM rows a wave later.
#           Predicted: the KV heads fastest (or head-major pages) bring the 64-128-row attention from 1.3-1.6x its
#           KV floor towards ~1.15x (the 256-row case's), ~10-15 us a layer at 96 rows. The heads fastest also start
#           a served batch's longest sequences first (rows in admission order: the oldest has generated the most;
#           the 140-650 cases): with the sequences fastest, the longest sequence's last heads start in the second
#           wave. Predicted there: another -3 to -6 us a layer. Then its GPU test.
#   CALL=first: CALL=decode; on a GPU the mid GEMM's table lacks (the H200), its tuning (BUDGET s, into the installed table,
#           copied into the logs as mid_gemm.json); then device_session27.sh's CALL=streams (the new GPU tests, then the
#           chat-shape mixed step on SPECS). Predictions (28th): the prefill grid bounded to 4 prompt chunks (b4)
#           -0.4 to -0.6 ms a chat mixed step, the WS prefill attention under PDL (pdl0 is without) -0.05 to -0.15,
#           the step split by rows on two streams (streams2) another -0.1 to -0.2.
#   CALL=served: chat at qps LEVELS (32; base at BASE_LEVELS, 1,32) (DURATION s a level) on SERVED_SPECS engines: base (the served config), b4
#           (mixed_graph_chunk_seqs = 4), streams2b4 (and the split by rows), mid0 (the mid GEMM off, cuBLAS), heads (the decode attention's KV heads fastest).
#           Since the session's end the three are the defaults (the bound at 8): base has them, old turns them off.
#   CALL=h200: the mid GEMM's tuning on a GPU its table lacks, then CALL=served on "base old" at qps 1 and 32.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=first COMMIT=abc1234 bash scripts/device_session29.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, gpu_tests, tune_mid_unless_tuned
session_logs s29

case ${CALL:-first} in
  decode)
    timeout "${DECODE_S:-150}" python3 "$SCRIPTS/bench_decode_splits.py" --rope \
      --variants nhd:seq,nhd:heads,hnd:seq,hnd:heads --cases "${CASES:-96x140-650,128x140-650,64x384,96x350,128x384,256x640,12x3000}" \
      --json "$LOGS/decode_variants.json" > "$LOGS/decode_variants.log" 2>&1
    echo "decode variants rc=$?"; grep "^B=" "$LOGS/decode_variants.log"; pack
    gpu_tests grid_order 90 tests/backend_cuda/test_fused_decode_attention.py -k grid_order ;;
  first)  # the 28th session's GPU tests (its prefill-grid and mixed-step changes serve on main unrun), CALL=decode,
    # the tuning where the table lacks this GPU, then the streams A/B if the call has time left
    gpu_tests s28 "${TEST_S:-80}" tests/backend_cuda/test_attention.py tests/backend_cuda/test_attention_prefill_ws.py \
      tests/backend_cuda/test_mixed_rope_attention.py tests/backend_cuda/test_qk_norm_rope.py \
      -k "two_streams or mixed or port or ws or pdl or rope"
    CALL=decode bash "$0"
    tune_mid_unless_tuned first "${BUDGET:-120}"
    if [ "$SECONDS" -lt "${STREAMS_BEFORE_S:-300}" ]; then
      OUT=$OUT TEST_S=0 CALL=streams COMMIT=$COMMIT bash "$(dirname "$0")/device_session27.sh"
    fi ;;
  h200)  # prepared for the next H200 (one call, ~6-7 min): the mid GEMM's tuning where the table lacks this GPU (the
    # 2-8-row o_proj / down on cuBLAS there: the qps-1 p50's suspect), then the served defaults against the old ones
    # (chat at qps 1 and 32, DURATION s a level, with the tuned table installed). Copy the returned mid_gemm.json into
    # packages/infer-backend-cuda/src/infer_backend_cuda/configs/.
    tune_mid_unless_tuned h200 "${BUDGET:-150}"
    SERVED_SPECS="${SERVED_SPECS:-base old}" LEVELS=${LEVELS:-1,32} CALL=served bash "$0" ;;
  served)
    for spec in ${SERVED_SPECS:-base b4 streams2b4}; do
      extra=()
      case $spec in *b4*) extra+=(RUSTINFER_MIXED_GRAPH_CHUNK_SEQS=4) ;; esac
      case $spec in streams*) on=${spec#streams}; extra+=("INFER_CUDA_MIXED_ATTENTION_STREAMS=${on%%b*}") ;; esac
      case $spec in mid0) extra+=(INFER_CUDA_MID_GEMM=0) ;; esac
      case $spec in *heads*) extra+=(INFER_CUDA_DECODE_HEADS_FASTEST=1) ;; esac
      case $spec in old) extra+=(RUSTINFER_MIXED_GRAPH_CHUNK_SEQS=0 INFER_CUDA_MIXED_ATTENTION_STREAMS=0
                                 INFER_CUDA_DECODE_HEADS_FASTEST=0) ;; esac
      engine_up "$spec" RUSTINFER_MAX_MODEL_LEN=32768 "${extra[@]}" || continue
      levels=${LEVELS:-32}; [ "$spec" = base ] && levels=${BASE_LEVELS:-1,32}
      sweep "${spec}_chat" "$levels"
      engine_down "$spec"; pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
