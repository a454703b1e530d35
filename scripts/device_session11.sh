#!/usr/bin/env bash
# The eleventh session's device calls, each part bounded, the logs packed into $OUT/s11.tar.gz after every part.
#   CALL=1: the AWQ kernels' GPU tests; the AWQ GEMMs at 2 / 4 / 8 rows (`bench_quant_gemm.py`: the decode tiles
#           with the run-time nibble magic and SCALE_AFTER, their candidates against the GEMV); the AWQ decode
#           replay at 1 / 2 / 4 / 8 rows with the defaults and with two rows in the tiled kernel; BF16 beside it; FP8 at batch 64 / 128 (profile).
#   CALL=2: the AWQ GPU tests at Qwen3-4B shapes with the tuned table; one row tuned (GEMV or decode tile) into the
#           installed table; the AWQ replay at 1 / 2 / 4 / 8 rows with it; chat at qps 1 for AWQ and BF16.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session11.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/s11; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
SCRIPTS=packages/infer-backend-cuda/scripts
echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$LOGS/commit.txt"
pack() { tar -czf "$OUT/s11.tar.gz" -C "$OUT" s11 $( [ -d "$OUT/engines" ] && echo engines ); }

source "$(dirname "$0")/device_lib.sh"  # roofline, gpu_tests

case ${CALL:-1} in
  1)
    gpu_tests awq "${TEST_TIMEOUT:-90}" tests/backend_cuda/test_quant_gemm.py tests/backend_cuda/test_split_k_fixup.py \
      -k "awq or quantized_gemms"
    timeout $(( ${TUNE_S:-150} + 60 )) python3 "$SCRIPTS/bench_quant_gemm.py" --formats awq --ms "${MS:-2,4,8}" \
      --budget-s "${TUNE_S:-150}" --json "$LOGS/quant_awq.json" > "$LOGS/quant_awq.log" 2>&1
    echo "bench_quant_gemm rc=$?"; tail -16 "$LOGS/quant_awq.log"; pack
    roofline roofline_awq qwen3-4b-awq 1,2,4,8
    roofline roofline_awq_tiled2 qwen3-4b-awq 2 INFER_CUDA_AWQ_GEMV_MAX_M=1 INFER_CUDA_AWQ_ROW_PROGRAMS=1
    roofline roofline_bf16 qwen3-4b 1,2,4,8
    ROOFLINE_ARGS="--context 384" roofline roofline_fp8_b64 qwen3-4b-fp8 64,128
    ;;
  2)
    gpu_tests awq_shapes "${TEST_TIMEOUT:-60}" tests/backend_cuda/test_quant_gemm.py -k "awq_qwen3_4b or quantized_gemms"
    # one row: the GEMV against the decode tiles tuned at 2-16 rows, the bests into the installed table
    TABLE=$(python3 -c "from infer_backend_cuda.kernels import awq_gemm as A; print(A._TABLE)")
    timeout 120 python3 "$SCRIPTS/bench_quant_gemm.py" --formats awq --ms 1 --budget-s "${TUNE_S:-50}" \
      --json "$LOGS/quant_awq_m1.json" --table "$TABLE" > "$LOGS/quant_awq_m1.log" 2>&1
    echo "bench_quant_gemm m1 rc=$?"; tail -5 "$LOGS/quant_awq_m1.log"; cp "$TABLE" "$LOGS/awq_gemm_table.json"; pack
    roofline roofline_awq_table qwen3-4b-awq 1,2,4,8
    ENGINES=${ENGINES:-"awq:chat=1,8,32 bf16:chat=1"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
esac
pack
