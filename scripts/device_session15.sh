#!/usr/bin/env bash
# The fifteenth session's device calls, each part bounded, the logs packed into $OUT/s15.tar.gz after every part.
#   CALL=steps: what a prompt chunk costs beside 12 decodes at 3k context (`bench/mixed_step.py`, graph and eager,
#           with 768 / 1536-token buckets captured too), then the ~3k-token prompts at qps 4 on the default config
#           (chunks now fitted to the graph buckets beside decodes: the 2,048-token chunk no longer runs eagerly).
#   CALL=profile: the kernels of those steps (a decode-only step, a 500- and a 1,012-token chunk's).
#   CALL=splits: the decode attention's split count (wave targets; `bench_decode_splits.py`). Calls 4 and 5 ran it with
#           two kernel variants measured and dropped since (a fewest-keys-a-split rule; the key loop's loads issued
#           early): docs/benchmarks.md, "Fifteenth device session".
#   CALL=quant: FP8 / AWQ / BF16 Qwen3-4B decode replays at 1, 2, 4 and 8 rows (context 279), with kernel profiles.
#   CALL=fp8one: FP8's one row in the tensor-core tiles (GPU tests, replays at 1-2 rows); BF16 batch 1 in three processes.
#   CALL=tilequant: FP8 decode tiles quantizing their own activations (`INFER_CUDA_FP8_TILE_QUANT`) against the
#           quantization kernel: the GPU tests, then 1-8-row replays with it off / on, twice each, in turn. Ran at
#           0145a7a (call 11): 2.4-2.6x slower, so the switch was removed; at later trees both runs are the same.
#   CALL=caps: the ~3k-token prompts at qps 4 with the caps CAPS (prompt tokens a step while decoding; a cap that is
#           not a default bucket gets a graph bucket of its own: `RUSTINFER_CAPTURE_TOKENS`).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=steps COMMIT=abc1234 bash scripts/device_session15.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep
session_logs s15
URL=http://127.0.0.1:8000
DURATION=${DURATION:-15}
DEFAULT_TOKENS="64 128 256 512 1024 2048"

long_with_cap() {  # long_with_cap CAP: an engine whose steps carry at most CAP prompt tokens while decoding, ~3k prompts at qps 4
  local cap=$1 tokens=$DEFAULT_TOKENS
  case " $tokens " in *" $cap "*) ;; *) [ "$cap" = 0 ] || tokens=$(echo "$tokens $cap" | tr ' ' '\n' | sort -n | tr '\n' ' ') ;; esac
  local list; list="[$(echo $tokens | tr ' ' ',')]"
  engine_up "cap$cap" RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PREFILL_TOKENS_WHILE_DECODING="$cap" \
    RUSTINFER_CAPTURE_TOKENS="$list" || return 1
  sweep "cap${cap}_long" 4 --workload long
  engine_down "cap$cap"
  pack
}

case ${CALL:-steps} in
  steps)
    timeout 300 python3 bench/mixed_step.py --model-dir bench/models/qwen3-4b --decodes 12 --context 3000 \
      --prompt 3000 --chunks 0,244,500,756,1012,1524,2036,2988 --capture-tokens 64,128,256,512,768,1024,1536,2048 \
      --eager --steps 8 --out "$LOGS/mixed_step.json" > "$LOGS/mixed_step.log" 2>&1
    echo "mixed_step rc=$?"; tail -10 "$LOGS/mixed_step.log"; pack
    long_with_cap 0 ;;
  profile)  # the kernels of a decode-only step and of a 500-token chunk's step beside 12 decodes at 3k context
    # (PDL=0 for kernel times that do not overlap: the step is then slower than served)
    env ${PDL:+INFER_CUDA_PDL=$PDL} timeout 300 python3 bench/mixed_step.py --model-dir bench/models/qwen3-4b --decodes 12 --context 3000 \
      --prompt 3000 --chunks 0,500,1012 --profile 0,500,1012 --steps 8 --out "$LOGS/mixed_profile.json" \
      > "$LOGS/mixed_profile.log" 2>&1
    echo "mixed_step rc=$?"; cat "$LOGS/mixed_profile.log" | grep -v '^{'; pack ;;
  splits)  # the decode attention's split rule at served shapes (`bench_decode_splits.py`)
    timeout 300 python3 $SCRIPTS/bench_decode_splits.py --json "$LOGS/decode_splits.json" > "$LOGS/decode_splits.log" 2>&1
    echo "decode_splits rc=$?"; cat "$LOGS/decode_splits.log"; pack ;;
  quant)  # the quantized decode replays at 1-8 rows (FP8 not measured since its scale prefetch and PDL)
    roofline fp8_rows qwen3-4b-fp8 1,2,4,8
    roofline awq_rows qwen3-4b-awq 1,2,4,8
    roofline bf16_rows qwen3-4b 1,2,4,8 ;;
  fp8one)  # FP8's one row in the tensor-core tiles: the GPU tests, the replays; BF16 batch 1 in three processes
    gpu_tests fp8 150 tests/backend_cuda/test_quant_gemm.py -k "fp8_qwen3_4b or (replay and fp8) or fp8_decode_rows"
    roofline fp8_one qwen3-4b-fp8 1,2
    for i in 1 2 3; do roofline "bf16_one_$i" qwen3-4b 1; done ;;
  tilequant)  # FP8 decode tiles quantizing their own activations (INFER_CUDA_FP8_TILE_QUANT) against the separate pass
    gpu_tests tilequant 90 tests/backend_cuda/test_quant_gemm.py -k "tiles_quantizing or fp8_qwen3_4b"
    for q in 0 1 0 1; do roofline "fp8_tq$q" qwen3-4b-fp8 1,2,4,8 INFER_CUDA_FP8_TILE_QUANT=$q; done ;;
  caps)
    for cap in ${CAPS:-0 512 1024}; do long_with_cap "$cap"; done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
