#!/usr/bin/env bash
# Thirty-first session's device calls (docs/benchmarks.md, "Thirty-first device session").
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default next).
#   CALL=h200: the mid GEMM tuned where the table lacks this GPU (copy the returned mid_gemm.json into
#           packages/infer-backend-cuda/src/infer_backend_cuda/configs/), chat at qps 1 and 32 with that table, the
#           ~3,000-token prompts at qps 4 with the 512-token cap (LONG_S s), then CALL=probe.
#   CALL=next: CALL=probe, then the thirtieth session's CALL=next (the kernel-variant GPU tests, chat at qps 1 and 8).
#   CALL=fixup: the split-K GEMMs (down, o_proj; qkv: 96 tiles on 132 SMs) at 64-128 rows by K ranges: the mid
#           GEMM with the last arrival's fix-up, with a reduce launch instead, and the same loop leaving its partials
#           unsummed (call 1: at 96 rows the fix-up's down was 2.6 us slower than the loop without it, 27.3 against
#           24.6, cuBLAS 26.5).
#   CALL=early (ran in the 32nd session; the early check then removed, so its switch no longer exists): the split-K
#           fix-up's early check (off by default): its GPU tests, the split mid GEMMs with and
#           without it, decode replays (BF16 at 16 / 64 rows, AWQ at 1 / 8) with and without it (~7 min).
#   CALL=probe: packages/infer-backend-cuda/scripts/probe_mid_l2.py: is the mid GEMM at 64-128 rows bound by the
#           activation tiles re-read from L2 (full / x_once / w_once, 96 rows as 64 + 32-row tiles)?
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session31.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, sweep, gpu_tests, gpu_branch, h200_served, ...
session_logs s31

case ${CALL:-auto} in
  auto) CALL=$(gpu_branch) bash "$0" ;;
  h200)
    h200_served
    CALL=probe bash "$0" ;;
  next)
    CALL=probe bash "$0"
    CALL=next OUT="$OUT" bash scripts/device_session30.sh ;;
  fixup)
    PROBE_ARGS="--shapes down,o_proj,qkv --ms 64,96,128 --tiles 64:128:4:4,64:64:4:4 --splits 2,3,4,6"
    PROBE_ARGS="$PROBE_ARGS --modes mid,mid_reduce,full" CALL=probe bash "$0" ;;
  early)  # the split-K fix-up's early check (split_k.py, INFER_CUDA_SPLIT_K_EARLY_LAST, off by default): its GPU tests
    # (real concurrency: both paths), then the split mid GEMMs without it (mid), with it (mid_early), the reduce
    # launch, no sum; then decode replays off / on
    gpu_tests early "${TEST_S:-100}" tests/backend_cuda/test_split_k_fixup.py tests/backend_cuda/test_mid_gemm.py
    PROBE_ARGS="--shapes down,o_proj --ms 16,64,96,128 --tiles 64:128:4:4 --splits 3,6"
    PROBE_ARGS="$PROBE_ARGS --modes mid,mid_early,mid_reduce,full" CALL=probe bash "$0"
    for early in 0 1; do  # BF16 where the mid GEMM splits K (64 rows: o_proj / down), AWQ's split GEMVs (1, 8 rows)
      roofline "bf16_early$early" qwen3-4b 16,64 INFER_CUDA_SPLIT_K_EARLY_LAST=$early
      roofline "awq_early$early" qwen3-4b-awq 1,8 INFER_CUDA_SPLIT_K_EARLY_LAST=$early
    done ;;
  probe)
    timeout "${PROBE_S:-150}" python3 "$SCRIPTS/probe_mid_l2.py" ${PROBE_ARGS:-} > "$LOGS/probe_l2.log" 2>&1
    echo "probe rc=$?"; grep '^{' "$LOGS/probe_l2.log"; pack ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
