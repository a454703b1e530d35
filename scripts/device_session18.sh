#!/usr/bin/env bash
# The eighteenth session's device calls (prepared in a session without device time), each part bounded, the logs
# packed into $OUT/s18.tar.gz after every part.
#   CALL=fp8nq: the RMSNorm in the FP8 quantization pass (INFER_CUDA_FP8_NORM_QUANT=1, off by default): its GPU
#           tests, FP8 decode replays at 1-128 rows with it and without (off, on, off, on), then FP8 chat at qps 1
#           and 32 on an engine with it and one without (issue 15: FP8's batch-1 replay and its qps-32 ITL p50
#           against BF16's 5.41 ms). Predicted: 72 launches a step fewer, ~2-3 us each where they sit on the
#           critical path (~0.1-0.2 ms at 1-128 rows).
#   CALL=phases: chat at qps 1 and 32 and ~3k-token prompts at qps 4 (cap 512) with the server's TTFT split
#           into queue, prefill and hops (`server_phases_ms`, bench/request_phases.py): where issue 14's
#           ~20 ms of long-prompt TTFT outside the prefill steps go.
# The seventeenth session's prepared calls still stand: CALL=next and CALL=rows2 of scripts/device_session17.sh.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=fp8nq COMMIT=abc1234 bash scripts/device_session18.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, model_dir, engine_up, engine_down, sweep, roofline, gpu_tests
session_logs s18  # also URL and DURATION (15 s a level unless given)
case ${CALL:-fp8nq} in
  fp8nq)
    gpu_tests fp8nq 120 tests/backend_cuda/test_quant_gemm.py tests/backend_cuda/test_quant_linear_ops.py \
      -k "norm"
    for nq in 0 1 0 1; do roofline "fp8_nq${nq}" qwen3-4b-fp8 1,2,8,64,96,128 INFER_CUDA_FP8_NORM_QUANT=$nq; done
    for nq in 1 0; do
      engine_up "fp8_nq$nq" RUSTINFER_MODEL="$(model_dir qwen3-4b-fp8)" RUSTINFER_MAX_MODEL_LEN=32768 \
        INFER_CUDA_FP8_NORM_QUANT=$nq || continue
      sweep "fp8_nq${nq}_chat" 1,32
      engine_down "fp8_nq$nq"; pack
    done ;;
  phases)
    engine_up phases RUSTINFER_MAX_MODEL_LEN=32768 || exit 1
    sweep phases_chat 1,32
    sweep phases_long 4 --workload long
    grep -h "server TTFT" "$LOGS"/sweep_phases_*.log
    engine_down phases; pack
    engine_up phases_cap RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PREFILL_TOKENS_WHILE_DECODING=512 || exit 1
    sweep phases_long_cap512 4 --workload long
    grep -h "server TTFT" "$LOGS"/sweep_phases_long_cap512.log
    engine_down phases_cap; pack ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
