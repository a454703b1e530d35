#!/usr/bin/env bash
# The tenth session's device calls, each part bounded, the logs packed into $OUT/s10.tar.gz after every part.
#   CALL=1 (ran at 517a87c, whose L2 weight prefetch measured slower and was removed): the L2 weight prefetch (GPU
#           test, batch-1 / 2 / 4 replays on and off); the skinny GEMM at 2 and 4 rows
#           tuned with the prefetch form (Qwen3-4B and Qwen3.5-4B shapes, into the installed table), then the decode
#           replay at 1 / 2 / 4 rows with the tuned table (against the committed one's above: the in-model A/B
#           decides what is committed); with EXTRA=1 (default) the decode attention's split waves at batch 64 / 128
#           and a PDL-off profile at batch 1 / 64.
#   CALL=2: one 16k-token prompt alone with idle_prefill_uses_step_budget on and off; BF16 chat at qps 1 / 8 / 32;
#           Qwen3.5-4B's 16k prompt and chat at qps 1 / 8 / 32 with the final defaults.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session10.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/s10; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
SCRIPTS=packages/infer-backend-cuda/scripts
echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$LOGS/commit.txt"
pack() { tar -czf "$OUT/s10.tar.gz" -C "$OUT" s10 $( [ -d "$OUT/engines" ] && echo engines ); }

source "$(dirname "$0")/device_lib.sh"  # roofline, gpu_tests

tune() {  # tune MODEL MS SECONDS: the prefetch candidates into the installed table
  timeout $(( $3 + 30 )) python3 "$SCRIPTS/bench_skinny_gemm.py" --model "$1" --prefetch --ops linear --ms "$2" \
    --budget-s "$3" --table "$TABLE" --json "$LOGS/tune_$1.json" > "$LOGS/tune_$1.log" 2>&1
  echo "tune $1 rc=$?"; grep -A14 "^ *op  *m" "$LOGS/tune_$1.log" | tail -14; pack
}

case ${CALL:-1} in
  1)
    gpu_tests l2 "${TEST_TIMEOUT:-60}" tests/backend_cuda/test_skinny_gemm.py -k "l2 or qwen3_shapes"
    # the L2 weight prefetch A/B with the committed table
    for l2 in 1 0; do
      roofline "roofline_qwen3-4b_l2$l2" qwen3-4b 1,2,4 INFER_CUDA_L2_PREFETCH=$l2
      roofline "roofline_qwen3.5-4b_l2$l2" qwen3.5-4b 1 INFER_CUDA_L2_PREFETCH=$l2
    done
    TABLE=$(python3 -c "from infer_backend_cuda.kernels import skinny_gemm as S; print(S._TABLE)")
    cp "$TABLE" "$LOGS/skinny_gemm_committed.json"
    tune qwen3-4b 2,4 "${TUNE_S:-90}"
    tune qwen3.5-4b 2,4 "${TUNE_S:-90}"
    cp "$TABLE" "$LOGS/skinny_gemm_tuned.json"
    roofline roofline_qwen3-4b_tuned qwen3-4b 1,2,4
    roofline roofline_qwen3.5-4b_tuned qwen3.5-4b 1,2,4
    cp "$LOGS/skinny_gemm_committed.json" "$TABLE"
    [ "${EXTRA:-1}" = 1 ] || { pack; exit 0; }
    # the decode attention at served batch sizes: the split count's waves, and a PDL-off profile (true kernel times)
    for waves in 2 4 8; do
      ROOFLINE_ARGS="--context 384" roofline "roofline_qwen3-4b_b64_waves$waves" qwen3-4b 64,128 \
        INFER_CUDA_DECODE_SPLIT_WAVES=$waves
    done
    ROOFLINE_ARGS="--context 384" roofline roofline_qwen3-4b_b1_64_nopdl qwen3-4b 1,64 INFER_CUDA_PDL=0
    ;;
  2)
    ENGINES=${ENGINES:-"bf16:16k+chat=1,8,32 bf16@IDLE_PREFILL_USES_STEP_BUDGET=false:16k qwen35:16k+chat=1,8,32"} \
      DURATION=${DURATION:-15} \
      OUT=$OUT COMMIT=$COMMIT bash scripts/device_engines.sh
    ;;
esac
pack
