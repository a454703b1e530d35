#!/usr/bin/env bash
# The fourteenth session's device calls, each part bounded, the logs packed into $OUT/s14.tar.gz after every part.
#   CALL=1: the decode attention asking L2 for o_proj's weight (`kernels/l2_prefetch.py`) and loading its first key
#           tile's page ids before `gdc_wait`: the GPU tests (values unchanged with the prefetch after the wait and
#           before it; the large shapes), then Qwen3-4B batch-1 replays with INFER_CUDA_L2_PREFETCH=0 / 1 / early
#           (two runs of 0 and 1), each its own process.
#   CALL=2: what call 1 leaves to confirm: Qwen3-4B at 2 / 4 / 8 / 64 rows and Qwen3.5-4B at one row with the
#           chosen mode, then Qwen3-4B BF16 chat at qps 1 / 32 (`ENGINES`).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session14.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, tune_table, roofline, gpu_tests
session_logs s14

case ${CALL:-1} in
  1)
    gpu_tests l2 "${TEST_TIMEOUT:-100}" tests/backend_cuda/test_fused_decode_attention.py -k "l2_prefetch or large"
    for mode in 0 1 early 0 1; do
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_l2_${mode}_$RANDOM" qwen3-4b 1 INFER_CUDA_L2_PREFETCH=$mode
    done
    ;;
  2)
    ROOFLINE_ARGS="--steps 40" roofline roofline_q3_rows qwen3-4b 1,2,4,8,64 INFER_CUDA_L2_PREFETCH=${MODE:-1}
    ROOFLINE_ARGS="--steps 40" roofline roofline_q35_one qwen3.5-4b 1 INFER_CUDA_L2_PREFETCH=${MODE:-1}
    ENGINES=${ENGINES:-"bf16:chat=1,32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT bash scripts/device_engines.sh
    ;;
esac
pack
