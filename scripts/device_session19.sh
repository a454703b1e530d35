#!/usr/bin/env bash
# The nineteenth session's device calls, each part bounded, the logs packed into $OUT/s19.tar.gz after every part.
#   CALL=mid: the mid GEMM (kernels/mid_gemm.py, 9-128 rows): its GPU tests, the tuning against cuBLAS at Qwen3-4B's
#           shapes into the installed table (bench_mid_gemm.py; the table copied into the logs), then decode
#           replays at 16-128 rows with the table and with INFER_CUDA_MID_GEMM=0 (context 400).
#           Predicted: cuBLAS takes ~69 us a layer at 64 rows against ~47 us of weight bytes; at ~3.6 TB/s the mid
#           kernel would take ~0.45 ms off a 64-row step.
#   CALL=mid2: the tuning again, replays at 24-128 rows (graph sizes between powers of two), then CALL=served.
#   CALL=fp8: the merge-variant warm-up's GPU test, then a shortened CALL=fp8nq of scripts/device_session18.sh.
#   CALL=next (prepared for the next session, on an H200): the tuning at 2-128 rows and replays at 2-96 rows; then
#           CALL=served (chat at qps LEVELS, 1, 8 and 32 by default, on an engine with the table and one without).
#   CALL=served: chat at qps LEVELS (1,8,32) on an engine with the table (TABLE=path of a tuned mid_gemm.json to install
#           first) and on one with INFER_CUDA_MID_GEMM=0.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=mid COMMIT=abc1234 bash scripts/device_session19.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, roofline, gpu_tests, tune_mid, tune_mid_unless_tuned
session_logs s19

replays_mid() {  # replays_mid TAG BATCHES: decode replays (context 400) with the table, then with cuBLAS
  ROOFLINE_TIMEOUT=${ROOFLINE_TIMEOUT:-110} ROOFLINE_ARGS="--context 400" roofline "$1_on" qwen3-4b "$2"
  ROOFLINE_TIMEOUT=${ROOFLINE_TIMEOUT:-110} ROOFLINE_ARGS="--context 400" roofline "$1_off" qwen3-4b "$2" \
    INFER_CUDA_MID_GEMM=0
}
case ${CALL:-mid} in
  mid)
    gpu_tests mid 150 tests/backend_cuda/test_mid_gemm.py
    tune_mid mid "${BUDGET:-200}"
    replays_mid mid 16,32,64,96,128
    gpu_tests mid_routes 120 tests/backend_cuda/test_skinny_gemm.py -k "routes or fused_port" ;;
  mid2)  # after the padded rows' fix: the tuning again (into the installed table, for whichever GPU this is), decode
    # replays at the graph sizes between powers of two with the table and without, then chat at qps 8 and 32 on an
    # engine with it and one without (DURATION s a level)
    tune_mid mid2 "${BUDGET:-120}"
    replays_mid mid2 24,48,80,96,128
    CALL=served bash "$0" ;;
  fp8)  # the merge variants warmed (GPU tests), then the eighteenth session's FP8 norm-in-quantization A/B, shortened:
    # FP8 decode replays at 1-128 rows off / on, then FP8 chat at qps 1 and 32 with it and without (DURATION s a level);
    # the engines' logs show any Triton compile while serving
    gpu_tests warm 120 tests/backend_cuda/test_compile_watch.py tests/backend_cuda/test_quant_linear_ops.py \
      tests/backend_cuda/test_quant_gemm.py -k "merge or norm"
    for nq in 0 1; do roofline "fp8_nq${nq}" qwen3-4b-fp8 1,2,8,64,128 INFER_CUDA_FP8_NORM_QUANT=$nq; done
    for nq in 1 0; do
      engine_up "fp8_nq$nq" RUSTINFER_MODEL="$(model_dir qwen3-4b-fp8)" RUSTINFER_MAX_MODEL_LEN=32768 \
        INFER_CUDA_FP8_NORM_QUANT=$nq || continue
      sweep "fp8_nq${nq}_chat" 1,32
      engine_down "fp8_nq$nq"; pack
    done
    grep -h "while serving" "$LOGS"/serve_fp8_*.log | cut -c1-200 ;;
  next)  # prepared for the next session, on an H200 (the table has no H200 entries yet): the GPU tests, the tuning at
    # 2-128 rows (BUDGET s; at 2-8 rows the shapes the skinny table leaves to cuBLAS), replays at 2-96 rows with the
    # table and without; then CALL=served in a second call
    gpu_tests next 100 tests/backend_cuda/test_mid_gemm.py tests/backend_cuda/test_compile_watch.py
    tune_mid next "${BUDGET:-150}"
    ROOFLINE_TIMEOUT=${ROOFLINE_TIMEOUT:-110} replays_mid next ${BATCHES:-1,2,4,8,64,96} ;;
  served)
    [ -n "${TABLE:-}" ] && cp "$TABLE" "$(installed_table mid_gemm)"
    tune_mid_unless_tuned served 90
    for on in ${ORDER:-1 0}; do
      engine_up "mid$on" RUSTINFER_MAX_MODEL_LEN=32768 INFER_CUDA_MID_GEMM=$on || continue
      sweep "mid${on}_chat" "${LEVELS:-1,8,32}"
      engine_down "mid$on"; pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
