#!/usr/bin/env bash
# Thirty-fifth session's device calls (docs/benchmarks.md, "Thirty-fifth device session").
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default targets).
#   CALL=h200 (~9 min with OTHER=targets): device_lib's `h200_served` flow (mid GEMM tuned for the H200: copy the
#           returned mid_gemm.json into packages/infer-backend-cuda/src/infer_backend_cuda/configs/; chat at qps 1 and
#           32; the ~3k prompts), then CALL=$OTHER.
#   CALL=targets (~1.5 min): the batch-1 replays of BF16 (1-2 rows), AWQ and FP8 (one row).
#   CALL=tune_fp8 / tune_awq (~5-7 min): bench/tune_in_model.py, the one-row configs of the scheme's linears
#           chosen by the decode step's replay, then the one-row replay on them; the installed tables come back (copy
#           the winners into configs/).
#   CALL=tune_dense (~6-8 min): the same for the BF16 model's GEMMs at ROWS rows (default 2: the chat sweep's qps 1
#           gaps come mostly from 2-6-row steps, and the H100's 2-row step replays slower than its 4-row one).
#   CALL=tables_ab (~3 min, after tunes on the same warm machine): the installed tables against the tree's, interleaved
#           (device_lib's `tables_ab`): BF16 1-4 rows, AWQ and FP8 one row. Commit a winner only where this confirms it.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session35.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, h200_then, roofline, tune_in_model, ...
session_logs s35

case ${CALL:-auto} in
  auto | h200) h200_then "$0" "${OTHER:-targets}" ;;
  targets)
    roofline bf16 qwen3-4b 1,2
    roofline awq qwen3-4b-awq 1
    roofline fp8 qwen3-4b-fp8 1 ;;
  tune_fp8) tune_in_model fp8 qwen3-4b-fp8 "${TUNE_S:-420}" ;;
  tune_awq) tune_in_model awq qwen3-4b-awq "${TUNE_S:-420}" ;;
  tune_dense) tune_in_model dense qwen3-4b "${TUNE_S:-480}" "${ROWS:-2}" ;;
  tables_ab)
    tables_ab bf16 qwen3-4b 1,2,4
    tables_ab awq qwen3-4b-awq 1
    tables_ab fp8 qwen3-4b-fp8 1 ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
