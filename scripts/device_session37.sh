#!/usr/bin/env bash
# Thirty-seventh session's device calls (docs/benchmarks.md, "Thirty-seventh session"). No device was lent in that
# session: these are prepared, in order of value.
#   CALL=auto: on an H200, device_lib's `h200_served` (~8 min: the mid GEMM tuned for the H200, chat at qps 1 and 32,
#           the ~3k prompts), then CALL=$OTHER (default preload); elsewhere CALL=$OTHER.
#   CALL=preload (~4 min): the tests of both preloads on the GPU, marked gpu or not (the skinny GEMM's peeled first
#           step bit for bit against the plain loop; the FP8 row-streaming kernel under PDL), then the BF16 step at 1,
#           2 and 4 rows with INFER_CUDA_SKINNY_PRELOAD 0 / 1, interleaved twice. Make it the default only where each
#           pair is lower.
#   CALL=fp8 (~8 min): device_session36.sh's `fp8` (the FP8 GPU tests, the in-model FP8 tuner, whose one-row
#           candidates include the row-streaming kernel, now under PDL, then `tables_ab`).
#   CALL=fp8_norm (~2 min, after CALL=fp8 on the same warm machine, whose tuned tables stay installed): the FP8
#           step at 1 and 128 rows with INFER_CUDA_FP8_NORM_QUANT 0 / 1 (the norm done by the quantization pass: slower
#           at 1-64 rows on the mid GEMM in the nineteenth session; the row-streaming kernel is new; 128 rows, qps 32's
#           steps, never measured), interleaved twice.
#   CALL=targets (~1.5 min): device_session35.sh's batch-1 replays of BF16 (1-2 rows), AWQ and FP8.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session37.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, h200_then, gpu_tests, switch_ab, ...
session_logs s37

case ${CALL:-auto} in
  auto | h200) h200_then "$0" "${OTHER:-preload}" ;;
  preload)
    MARK="gpu or not gpu" gpu_tests preload 180 tests/backend_cuda/test_skinny_gemm.py \
      tests/backend_cuda/test_quant_gemm.py -k "preload or row_wise or row_streaming or qwen3_shapes"
    switch_ab bf16_preload qwen3-4b 1,2,4 INFER_CUDA_SKINNY_PRELOAD ;;
  fp8) CALL=fp8 bash "$(dirname "$0")/device_session36.sh" ;;
  fp8_norm) switch_ab fp8_norm_quant qwen3-4b-fp8 1,128 INFER_CUDA_FP8_NORM_QUANT ;;
  targets) CALL=targets bash "$(dirname "$0")/device_session35.sh" ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
