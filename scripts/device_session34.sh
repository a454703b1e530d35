#!/usr/bin/env bash
# Thirty-fourth session's device calls (docs/benchmarks.md, "Thirty-fourth device session").
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default replays).
#   CALL=h200 (~9 min with OTHER=targets): the H200 flow of device_lib's `h200_served` (mid GEMM tuned for the H200:
#           copy the returned mid_gemm.json into packages/infer-backend-cuda/src/infer_backend_cuda/configs/; chat at
#           qps 1 and 32; the ~3k prompts), then CALL=$OTHER (replays by default: past one call's limit after it).
#   CALL=replays (~4 min): the gated AWQ GEMM's and the split-K sum's GPU tests, then decode replays as the defaults
#           now run: BF16 1-4 rows; AWQ 1 and 4 rows with the SiLU-and-mul in the gate / up GEMM's last programs
#           (INFER_CUDA_GATED_GEMM=1) and without (0), twice each; AWQ one row with the fix-up's partials read one
#           tile at a time (INFER_CUDA_SPLIT_K_SUM_CHUNK=0, the old sum); FP8 one row on its own sum (the reduce
#           launch) and on the fix-up (INFER_CUDA_SPLIT_K_FIXUP=1: the fix-up's sum is now chunked).
#   CALL=confirm (~3.5 min): the gated GPU test and AWQ replays at 1 and 4 rows, twice, with the gated form on the
#           tiled kernel only (the GEMV's measured slower in CALL=replays); between them one row with the default split
#           counts aimed at 1,024 programs (INFER_CUDA_SPLIT_K_TARGET_PROGRAMS: one group a program at one row).
#   CALL=targets (~1.5 min): BF16 1-2 rows, AWQ and FP8 one row (OTHER=targets after the H200 flow).
#   CALL=tune (~5-7 min a round): bench/tune_in_model.py --scheme awq, the AWQ one-row configs chosen by the decode
#           step's replay (~12 candidates a linear, the others fixed; the merged winners come back in awq_gemm.json).
#   CALL=maxnreg / ablate: the thirty-third session's (scripts/device_session33.sh), prepared there, not yet run.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session34.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, gpu_branch, h200_served, roofline, gpu_tests, ...
session_logs s34

case ${CALL:-auto} in
  auto | h200) h200_then "$0" "${OTHER:-replays}" ;;
  replays)
    gpu_tests gated "${TEST_S:-150}" tests/backend_cuda/test_awq_gated.py tests/backend_cuda/test_split_k_fixup.py
    roofline bf16 qwen3-4b 1,2,4
    for gated in 1 0 1 0; do
      roofline "awq_gated$gated" qwen3-4b-awq 1,4 INFER_CUDA_GATED_GEMM=$gated
    done
    roofline awq_chunk0 qwen3-4b-awq 1 INFER_CUDA_SPLIT_K_SUM_CHUNK=0
    roofline fp8 qwen3-4b-fp8 1
    roofline fp8_fixup1 qwen3-4b-fp8 1 INFER_CUDA_SPLIT_K_FIXUP=1 ;;
  confirm)  # the tree with the gated form on the tiled kernel alone: its GPU test, AWQ replays at 1 and 4 rows twice
    gpu_tests confirm "${TEST_S:-120}" tests/backend_cuda/test_awq_gated.py
    roofline awq_a qwen3-4b-awq 1,4
    roofline awq_t1024a qwen3-4b-awq 1 INFER_CUDA_SPLIT_K_TARGET_PROGRAMS=1024
    roofline awq_b qwen3-4b-awq 1,4
    roofline awq_t1024b qwen3-4b-awq 1 INFER_CUDA_SPLIT_K_TARGET_PROGRAMS=1024 ;;
  targets)  # the batch-1 targets alone (after the H200 flow, within one call's 10 minutes)
    roofline bf16 qwen3-4b 1,2
    roofline awq qwen3-4b-awq 1
    roofline fp8 qwen3-4b-fp8 1 ;;
  tune) tune_in_model awq qwen3-4b-awq "${TUNE_S:-420}" ;;  # copy the returned awq_gemm.json's winners into configs/
  maxnreg | ablate) bash "$(dirname "$0")/device_session33.sh" ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
