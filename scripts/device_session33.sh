#!/usr/bin/env bash
# Thirty-third session's device calls (docs/benchmarks.md, "Thirty-third device session").
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default replays).
#   CALL=h200 (~8 min): the thirty-first's H200 flow (mid GEMM tuned for the H200: copy the returned mid_gemm.json
#           into packages/infer-backend-cuda/src/infer_backend_cuda/configs/; chat at qps 1 and 32; the ~3k
#           prompts), then CALL=replays.
#   CALL=replays (~2 min): decode replays as the defaults now run: BF16 1-4 rows (the 32-key tile up to two
#           sequences), AWQ one row (its weights before the wait where they fit, `awq_gemv.preloads`; and without,
#           INFER_CUDA_AWQ_PRELOAD=0: the H200's tuned one-row configs differ from the H100's), FP8 one row (the
#           BF16 / AWQ / FP8 batch-1 targets).
#   CALL=preload (~8 min): the AWQ one-row GEMV asking for its first group's weights before `gdc_wait`
#           (INFER_CUDA_AWQ_PRELOAD=1) against after it (0): GPU tests (AWQ kernels, quantized CUDA == CPU, the decode
#           attention), AWQ one-row replays 1 / 0 / 1 / 0, BF16 replays at 1-4 rows. Ran in this session (H100).
#   CALL=maxnreg (~3 min): the one-row AWQ GEMV capped at 128 registers (INFER_CUDA_AWQ_GEMV_MAXNREG: 8 programs an
#           SM instead of 6, so qkv's 960 fit one wave) against uncapped: its GPU test capped, AWQ one-row replays
#           uncapped / 128 / uncapped / 128.
#   CALL=ablate (~2 min): bench/ablate_step.py on the AWQ model at one row (what each GEMV costs inside the chain with
#           its weights asked for before the wait; the thirty-second session's ran without).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session33.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, gpu_branch, h200_served, roofline, gpu_tests, ...
session_logs s33

case ${CALL:-auto} in
  auto | h200) h200_then "$0" "${OTHER:-replays}" ;;
  replays)
    roofline bf16 qwen3-4b 1,2,4
    roofline awq qwen3-4b-awq 1
    roofline awq_pre0 qwen3-4b-awq 1 INFER_CUDA_AWQ_PRELOAD=0
    roofline fp8 qwen3-4b-fp8 1 ;;
  preload)
    gpu_tests preload "${TEST_S:-400}" tests/backend_cuda/test_quant_gemm.py tests/backend_cuda/test_split_k_fixup.py \
      tests/backend_cuda/test_quant_linear_ops.py tests/gpu/test_quantized_cuda_matches_cpu.py \
      tests/backend_cuda/test_attention.py tests/backend_cuda/test_fused_decode_attention.py
    for pre in 1 0 1 0; do
      roofline "awq_pre${pre}" qwen3-4b-awq 1 INFER_CUDA_AWQ_PRELOAD=$pre
    done
    roofline bf16_tile qwen3-4b 1,2,4 ;;
  maxnreg)
    gpu_tests maxnreg "${TEST_S:-120}" tests/backend_cuda/test_awq_preload.py
    for cap in "" 128 "" 128; do
      roofline "awq_maxnreg${cap:-_none}" qwen3-4b-awq 1 INFER_CUDA_AWQ_GEMV_MAXNREG=$cap
    done ;;
  ablate)
    ablate qwen3-4b-awq "${ABLATE_BATCHES:-1}" "${ABLATE_S:-200}" ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
