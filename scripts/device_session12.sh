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
source "$(dirname "$0")/device_lib.sh"  # session_logs, roofline, gpu_tests
session_logs s12

case ${CALL:-2} in
  2)
    gpu_tests fp8 "${TEST_TIMEOUT:-70}" tests/backend_cuda/test_quant_gemm.py -k "fp8"
    TABLE=$(python3 -c "from infer_backend_cuda.kernels import fp8_gemm as F; print(F._TABLE)")
    timeout $(( ${TUNE_S:-140} + 60 )) python3 "$SCRIPTS/bench_quant_gemm.py" --formats fp8 --ms "${MS:-16,32,64,128}" \
      --budget-s "${TUNE_S:-140}" --json "$LOGS/quant_fp8.json" --table "$TABLE" > "$LOGS/quant_fp8.log" 2>&1
    echo "bench_quant_gemm fp8 rc=$?"; tail -17 "$LOGS/quant_fp8.log"; cp "$TABLE" "$LOGS/fp8_gemm_table.json"; pack
    ROOFLINE_ARGS="--context 384" roofline roofline_fp8_table qwen3-4b-fp8 64,128
    ENGINES=${ENGINES:-"fp8:chat=32 bf16:chat=32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
  3)
    gpu_tests fp8 "${TEST_TIMEOUT:-70}" tests/backend_cuda/test_quant_gemm.py -k "fp8"
    TABLE=$(python3 -c "from infer_backend_cuda.kernels import fp8_gemm as F; print(F._TABLE)")
    timeout $(( ${TUNE_S:-100} + 60 )) python3 "$SCRIPTS/bench_quant_gemm.py" --formats fp8 --ms "${MS:-64,128}" \
      --budget-s "${TUNE_S:-100}" --json "$LOGS/quant_fp8_pdl.json" --table "$TABLE" > "$LOGS/quant_fp8_pdl.log" 2>&1
    echo "bench_quant_gemm fp8 rc=$?"; tail -9 "$LOGS/quant_fp8_pdl.log"; cp "$TABLE" "$LOGS/fp8_gemm_table.json"; pack
    ROOFLINE_ARGS="--context 384" roofline roofline_fp8_pdl qwen3-4b-fp8 64,128
    ROOFLINE_ARGS="--context 384" roofline roofline_bf16 qwen3-4b 64,128
    ENGINES=${ENGINES:-"fp8:chat=32 bf16:chat=32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
esac
pack
