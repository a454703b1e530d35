#!/usr/bin/env bash
# The ninth session's device calls, each part bounded, the logs packed into $OUT/s9.tar.gz after every part.
#   CALL=1: what the eighth session left unmeasured: the AWQ replay at 1-8 rows with the final decode forms, AWQ chat
#           at qps 1 / 8 / 32 with them; FP8 chat at qps 32 and its GEMMs at 16-96 rows; the prefill attention's tile
#           configs at 8k chunks.
#   CALL=3: each attention fusion alone and the gated GEMM (batch-1 A/B), Qwen3.5, then CALL=1 (EXTRA=1).
#   CALL=4: BF16 chat at qps 1 / 8 / 32 with the final defaults; the AWQ tiled kernel's configs at 4 and 8 rows.
#   CALL=2: the fused decode attention and the gated gate / up GEMM (GPU tests, then the batch-1 replays of Qwen3-4B
#           and Qwen3.5-4B with them and without, INFER_CUDA_FUSED_DECODE_ATTENTION=0 INFER_CUDA_GATED_GEMM=0), BF16
#           chat at qps 1.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session9.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/s9; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
SCRIPTS=packages/infer-backend-cuda/scripts
echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$LOGS/commit.txt"
pack() { tar -czf "$OUT/s9.tar.gz" -C "$OUT" s9 $( [ -d "$OUT/engines" ] && echo engines ); }

source "$(dirname "$0")/device_lib.sh"  # roofline, gpu_tests

case ${CALL:-1} in
  1)
    roofline roofline_qwen3-4b-awq_rows qwen3-4b-awq 1,2,3,4,8
    ENGINES=${ENGINES:-"awq:chat=1,8,32 fp8:chat=32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    pack
    timeout "${QGEMM_TIMEOUT:-60}" python3 "$SCRIPTS/bench_quant_gemm.py" --budget-s $(( ${QGEMM_TIMEOUT:-60} - 10 )) \
      --formats fp8 --ms 16,32,64,96 --json "$LOGS/qgemm_fp8.json" > "$LOGS/qgemm_fp8.log" 2>&1
    echo "qgemm fp8 rc=$?"; tail -12 "$LOGS/qgemm_fp8.log"; pack
    timeout "${ATTN_TIMEOUT:-50}" python3 bench/attention_prefill.py --chunks 8192 --no-sdpa --reps 5 \
      --configs default 128,128,8,3 128,64,8,3 64,128,4,3 > "$LOGS/attention_prefill.log" 2>&1
    echo "attention rc=$?"; tail -8 "$LOGS/attention_prefill.log"; pack
    ;;
  2)
    gpu_tests fused "${TEST_TIMEOUT:-100}" tests/backend_cuda/test_fused_decode_attention.py \
      tests/backend_cuda/test_skinny_gemm.py tests/backend_cuda/test_attention.py tests/gpu/test_qwen3_5_cuda.py \
      tests/gpu/test_cuda_matches_cpu.py
    roofline roofline_qwen3-4b_fused qwen3-4b 1,2,4
    roofline roofline_qwen3-4b_unfused qwen3-4b 1 INFER_CUDA_FUSED_DECODE_ATTENTION=0 INFER_CUDA_GATED_GEMM=0
    roofline roofline_qwen3-4b_attention_only qwen3-4b 1 INFER_CUDA_GATED_GEMM=0
    roofline roofline_qwen3.5-4b_fused qwen3.5-4b 1
    roofline roofline_qwen3.5-4b_unfused qwen3.5-4b 1 INFER_CUDA_FUSED_DECODE_ATTENTION=0 INFER_CUDA_GATED_GEMM=0
    ENGINES=${ENGINES:-"bf16:chat=1"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT bash scripts/device_engines.sh
    ;;
  3)  # after the second call: each fusion on its own (A/B at batch 1), then Qwen3.5, then (EXTRA=1) CALL=1
    gpu_tests fused_3 "${TEST_TIMEOUT:-60}" tests/backend_cuda/test_fused_decode_attention.py
    for variant in 0 merge rope 1; do
      roofline "roofline_qwen3-4b_attn_$variant" qwen3-4b 1 INFER_CUDA_FUSED_DECODE_ATTENTION=$variant \
        INFER_CUDA_GATED_GEMM=0
    done
    roofline roofline_qwen3-4b_gated qwen3-4b 1
    roofline roofline_qwen3.5-4b_attn_1 qwen3.5-4b 1 INFER_CUDA_GATED_GEMM=0
    roofline roofline_qwen3.5-4b_attn_0 qwen3.5-4b 1 INFER_CUDA_GATED_GEMM=0 INFER_CUDA_FUSED_DECODE_ATTENTION=0
    [ "${EXTRA:-1}" = 1 ] || { pack; exit 0; }
    CALL=1 OUT=$OUT COMMIT=$COMMIT bash "$0"
    ;;
  4)  # the gated GEMM with its pairs adjacent (A/B at batch 1); the served figures with the final defaults; the AWQ
      # tiled kernel's configs at 4 and 8 rows
    gpu_tests gated "${TEST_TIMEOUT:-40}" tests/backend_cuda/test_skinny_gemm.py -k "silu_mul or epilogue"
    roofline roofline_qwen3-4b_plain qwen3-4b 1
    roofline roofline_qwen3-4b_gated_pairs qwen3-4b 1 INFER_CUDA_GATED_GEMM=1
    ENGINES=${ENGINES:-"bf16:chat=1,8,32 qwen35:chat=1"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    pack
    [ "${EXTRA:-1}" = 1 ] || { pack; exit 0; }
    timeout "${QGEMM_TIMEOUT:-90}" python3 "$SCRIPTS/bench_quant_gemm.py" --budget-s $(( ${QGEMM_TIMEOUT:-90} - 10 )) \
      --formats awq --ms 4,8 --json "$LOGS/qgemm_awq_4_8.json" > "$LOGS/qgemm_awq_4_8.log" 2>&1
    echo "qgemm awq 4,8 rc=$?"; tail -10 "$LOGS/qgemm_awq_4_8.log"; pack
    ;;
esac
pack
