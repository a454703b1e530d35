#!/usr/bin/env bash
# The twentieth session's device calls, each part bounded, the logs packed into $OUT/s20.tar.gz after every part.
#   CALL=fp8mid: block FP8 on the mid GEMM (mid_gemm.py BLOCK_SCALED, 1-128 rows): its GPU tests, the tuning of
#           fp8_linear / fp8_linear_silu_mul against the FP8 path it replaces (the quantization kernel, then the
#           Triton tiles to 64 rows and cuBLASLt's block-scaled GEMM from 65) into the installed mid table, then FP8
#           decode replays at 1-128 rows with the table and with INFER_CUDA_MID_GEMM=0 (context 400).
#           Predicted (H100): Qwen3-4B's FP8 linears are 101 MB a layer; at ~2.8 TB/s ~36 us a layer, ~1.3 ms a
#           step, against ~2.9 ms of GEMMs and quantization at 96-128 rows today (H200 figure, fifteenth session).
#   CALL=served: chat at qps LEVELS (1,8,32) on FP8 with the table (TABLE=path of a tuned mid_gemm.json installed
#           first; tuned here when the GPU's table lacks FP8 entries), then BF16 with it, then FP8 without (FP8_OFF=1).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=fp8mid COMMIT=abc1234 bash scripts/device_session20.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, roofline, gpu_tests, tune_mid
session_logs s20

tune_fp8_mid() {  # tune_fp8_mid TAG BUDGET_S: tune_mid of the FP8 ops (at 1-128 rows unless MS says)
  OPS=${OPS:-fp8_linear,fp8_linear_silu_mul} MS=${MS:-1,2,8,16,32,64,128,4} tune_mid "$@"
}

case ${CALL:-fp8mid} in
  fp8mid)
    gpu_tests fp8mid 150 tests/backend_cuda/test_mid_gemm_fp8.py
    tune_fp8_mid fp8mid "${BUDGET:-170}"
    for on in 1 0; do
      ROOFLINE_TIMEOUT=110 ROOFLINE_ARGS="--context 400" roofline "fp8_mid$on" qwen3-4b-fp8 1,2,8,32,64,96,128 \
        INFER_CUDA_MID_GEMM=$on
    done ;;
  uniform)  # one weight scale a tile (W_SCALE_UNIFORM): the GPU tests, fp8_linear re-tuned at 32-128 rows, FP8
    # replays there (against CALL=fp8mid's fp8_mid1 on the same GPU kind)
    gpu_tests uniform 120 tests/backend_cuda/test_mid_gemm_fp8.py
    OPS=fp8_linear MS=32,64,128 tune_fp8_mid uniform "${BUDGET:-80}"
    ROOFLINE_TIMEOUT=100 ROOFLINE_ARGS="--context 400" roofline fp8_uniform qwen3-4b-fp8 32,64,96,128 ;;
  served)
    [ -n "${TABLE:-}" ] && cp "$TABLE" "$(installed_table mid_gemm)"
    if ! grep -q fp8_linear "$(installed_table mid_gemm)"; then tune_fp8_mid served 100; fi
    runs="fp8:1 bf16:1"; [ -n "${FP8_OFF:-}" ] && runs="$runs fp8:0"
    for run in $runs; do
      fmt=${run%%:*} on=${run##*:}
      model=qwen3-4b; [ "$fmt" = fp8 ] && model=qwen3-4b-fp8
      engine_up "${fmt}_mid$on" RUSTINFER_MODEL="$(model_dir $model)" RUSTINFER_MAX_MODEL_LEN=32768 \
        INFER_CUDA_MID_GEMM=$on || continue
      sweep "${fmt}_mid${on}_chat" "${LEVELS:-1,8,32}"
      engine_down "${fmt}_mid$on"; pack
    done
    grep -h "while serving" "$LOGS"/serve_*.log | cut -c1-200 ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
