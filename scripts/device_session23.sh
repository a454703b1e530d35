#!/usr/bin/env bash
# The twenty-third session's device call, each part bounded, the logs packed into $OUT/s23.tar.gz after every part.
#   CALL=stages: the prefill attention's PIPE_QK key loop (2cbc147) against the default (GPU tests, bench at the ~3k
#           workload's chunks and a 16k prompt), torch's sdpa backends told apart, then the decode attention with a third
#           pipeline stage (INFER_CUDA_DECODE_TILE=64:4:3) against the default 64:4:2 where its grid fits one wave at
#           three programs an SM: the mixed step of 12 decodes at 3k context (+ a 500-token chunk), decode replays at
#           1-16 rows (context 400). The sixteenth session had 64:4:3 at 45.9 against 53.8 us a layer at 12 x 3,000 in
#           the plain kernel, and slower in the model at 64 rows, where its 512 programs need 1.3 waves. Last, the
#           decode attention's GPU tests on the tree's stage rule.
# Ran once (call 5, tree 043c98f plus a decode stage rule, both dropped after it: 4b72b02 reverted PIPE_QK, so the
# `,1` configs no longer parse; docs/benchmarks.md, twenty-third session). The sdpa part now lives in
# `bench/attention_prefill.py --sdpa-backends cudnn flash`.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=stages COMMIT=abc1234 bash scripts/device_session23.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, roofline, gpu_tests, pack
session_logs s23

case ${CALL:-stages} in
  stages)
    timeout 150 python3 bench/attention_prefill.py --tokens 3072 --chunks 512 3072 --no-sdpa \
      --configs default 128,128,8,2,1 128,64,8,2 128,64,8,2,1 > "$LOGS/attention_pipe_3k.log" 2>&1
    timeout 120 python3 bench/attention_prefill.py --chunks 16384 --no-sdpa --configs default 128,64,8,2,1 \
      > "$LOGS/attention_pipe_16k.log" 2>&1
    tail -12 "$LOGS"/attention_pipe_*.log; pack
    [ -f .bench-models/sdpa_backends.py ] && timeout 100 python3 .bench-models/sdpa_backends.py > "$LOGS/sdpa.log" 2>&1
    cat "$LOGS/sdpa.log" 2>/dev/null; pack
    for tile in 64:4:2 64:4:3; do  # 64:4:2 is the default
      INFER_CUDA_DECODE_TILE=$tile timeout 150 python3 bench/mixed_step.py \
        --decodes 12 --context 3000 --prompt 3000 --chunks 0,500 --capture-tokens 512 --steps 10 \
        --out "$LOGS/mixed_${tile//:/-}.json" > "$LOGS/mixed_${tile//:/-}.log" 2>&1
      echo "mixed $tile rc=$?"; tail -5 "$LOGS/mixed_${tile//:/-}.log"; pack
    done
    ROOFLINE_TIMEOUT=90 ROOFLINE_ARGS="--context 400" roofline stages2 qwen3-4b 1,2,4,8,16 INFER_CUDA_DECODE_TILE=64:4:2
    ROOFLINE_TIMEOUT=90 ROOFLINE_ARGS="--context 400" roofline stages3 qwen3-4b 1,2,4,8,16 INFER_CUDA_DECODE_TILE=64:4:3
    # the stage rule's variants on the GPU (the tree's default: three stages up to 24 sequences)
    gpu_tests decode 100 tests/backend_cuda/test_attention.py tests/backend_cuda/test_fused_decode_attention.py \
      -k "decode or mixed" ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
