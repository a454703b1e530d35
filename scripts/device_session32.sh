#!/usr/bin/env bash
# Thirty-second session's device calls (docs/benchmarks.md, "Thirty-second device session").
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default early).
#   CALL=h200: the thirty-first's H200 flow (mid GEMM tuned for the H200: copy the returned mid_gemm.json into
#           packages/infer-backend-cuda/src/infer_backend_cuda/configs/; chat at qps 1 and 32; the ~3k prompts), then
#           CALL=ablate.
#   CALL=early: the thirty-first's CALL=early (the split-K fix-up's early check: GPU tests, mid GEMMs, replays).
#   CALL=ablate: bench/ablate_step.py: decode replays with one part of the step made free (norms, attention, each
#           GEMM) at 1-128 rows: what each part costs inside the PDL chain (ABLATE_MODEL, default qwen3-4b).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=auto COMMIT=abc1234 bash scripts/device_session32.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, gpu_branch, h200_served, ...
session_logs s32

case ${CALL:-auto} in
  auto) OTHER=${OTHER:-early} CALL=$(gpu_branch) bash "$0" ;;
  h200)
    h200_served
    CALL=ablate bash "$0" ;;
  early) CALL=early OUT="$OUT" bash scripts/device_session31.sh ;;
  ablate)
    timeout "${ABLATE_S:-240}" python3 bench/ablate_step.py --model-dir "bench/models/${ABLATE_MODEL:-qwen3-4b}" \
      --batches "${ABLATE_BATCHES:-1,2,4,16,64,128}" --out "$LOGS/ablate_${ABLATE_MODEL:-qwen3-4b}.json" \
      > "$LOGS/ablate_${ABLATE_MODEL:-qwen3-4b}.log" 2>&1
    echo "ablate rc=$?"; tail -12 "$LOGS/ablate_${ABLATE_MODEL:-qwen3-4b}.log"; pack ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
