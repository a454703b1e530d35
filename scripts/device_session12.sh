#!/usr/bin/env bash
# The twelfth session's device calls, each part bounded, the logs packed into $OUT/s12.tar.gz after every part.
#   CALL=2: the FP8 kernels' GPU tests (scales loaded a group ahead); the FP8 GEMMs tuned at 16 / 32 / 64 / 128 rows
#           into the installed table (`bench_quant_gemm.py --formats fp8 --table`); the FP8 decode replay at 64 / 128
#           rows with it; FP8 and BF16 chat at qps 32.
#   CALL=3: the same with PDL in the FP8 kernels and one-row-tile candidates at 128 rows: GPU tests, tuning at 64 /
#           128 rows into the installed table, the FP8 and BF16 replays at 64 / 128 rows, FP8 and BF16 chat at qps 32.
# (CALL=1 of this session was the eleventh session's CALL=2.)
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=2 COMMIT=abc1234 bash scripts/device_session12.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, tune_table, roofline, gpu_tests
session_logs s12

case ${CALL:-2} in
  2)
    gpu_tests fp8 "${TEST_TIMEOUT:-70}" tests/backend_cuda/test_quant_gemm.py -k "fp8"
    tune_table fp8 "${MS:-16,32,64,128}" "${TUNE_S:-140}" quant_fp8
    ROOFLINE_ARGS="--context 384" roofline roofline_fp8_table qwen3-4b-fp8 64,128
    ENGINES=${ENGINES:-"fp8:chat=32 bf16:chat=32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
  3)
    gpu_tests fp8 "${TEST_TIMEOUT:-70}" tests/backend_cuda/test_quant_gemm.py -k "fp8"
    tune_table fp8 "${MS:-64,128}" "${TUNE_S:-100}" quant_fp8_pdl
    ROOFLINE_ARGS="--context 384" roofline roofline_fp8_pdl qwen3-4b-fp8 64,128
    ROOFLINE_ARGS="--context 384" roofline roofline_bf16 qwen3-4b 64,128
    ENGINES=${ENGINES:-"fp8:chat=32 bf16:chat=32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
esac
pack
