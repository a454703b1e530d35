#!/usr/bin/env bash
# Thirty-second session's device calls (docs/benchmarks.md, "Thirty-second device session").
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default confirm).
#   CALL=h200: the thirty-first's H200 flow (mid GEMM tuned for the H200: copy the returned mid_gemm.json into
#           packages/infer-backend-cuda/src/infer_backend_cuda/configs/; chat at qps 1 and 32; the ~3k prompts), then
#           CALL=confirm.
#   CALL=confirm (~3 min): each split-K kernel's own sum (AWQ the fix-up, mid / FP8 the reduce launch, 988999d): the
#           split-K and mid GEMM GPU tests, decode replays (BF16 16 / 64 rows, FP8 1 / 16, AWQ 1 / 8) as they now run.
#   CALL=tile (~3 min): the decode attention's key tile at 1-4 rows (32:4:2 against the default 64:4:2; call 5 on an
#           H100 at context ~280: -0.05 ms at 1-2 rows) at contexts 400 and 1,500, twice each.
#   CALL=ablate: bench/ablate_step.py: decode replays with one part of the step made free (norms, attention, each
#           GEMM) at 1-128 rows: what each part costs inside the PDL chain (ABLATE_MODEL, default qwen3-4b).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session32.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, gpu_branch, h200_served, roofline, gpu_tests, ...
session_logs s32

case ${CALL:-auto} in
  auto | h200) h200_then "$0" "${OTHER:-confirm}" ;;
  confirm)
    gpu_tests sum "${TEST_S:-100}" tests/backend_cuda/test_split_k_fixup.py tests/backend_cuda/test_mid_gemm.py \
      tests/backend_cuda/test_mid_gemm_fp8.py
    roofline bf16_sum qwen3-4b 16,64
    roofline fp8_sum qwen3-4b-fp8 1,16
    roofline awq_sum qwen3-4b-awq 1,8 ;;
  tile)
    for context in 400 1500; do
      for tile in 64:4:2 32:4:2 64:4:2 32:4:2; do
        ROOFLINE_ARGS="--context $context" roofline "tile${tile//:/_}_ctx$context" qwen3-4b 1,2,4 \
          INFER_CUDA_DECODE_TILE=$tile
      done
    done ;;
  ablate)
    ablate "${ABLATE_MODEL:-qwen3-4b}" "${ABLATE_BATCHES:-1,2,4,16,64,128}" "${ABLATE_S:-240}" ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
