#!/usr/bin/env bash
# The twenty-fourth session's device calls, each part bounded, the logs packed into $OUT/s24.tar.gz after every part.
#   CALL=gluon: the Gluon prefill attention (kernels/attention_prefill_gluon.py): its GPU tests and the prefill tests
#           it now serves, then the kernel alone against the Triton kernel's default tile (`triton`) at the ~3,000-token
#           workload's chunks and on a 16k prompt (cuDNN's sdpa as the yardstick), then the 500-token step beside 12
#           decodes at 3k context with it (INFER_CUDA_GLUON_PREFILL=1) and without.
#   CALL=stages: the kernel at 128 keys x 3 / 2 stages and 64 keys x 4 stages against the Triton kernel (same process)
#           at the 3k workload's chunks, 128 x 3 on a 16k prompt, then its GPU tests at 3 stages.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=gluon COMMIT=abc1234 bash scripts/device_session24.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, gpu_tests, pack
session_logs s24

mixed_step() {  # mixed_step TAG [env assignments...]: the 3k workload's mixed step (12 decodes, a 500-token chunk)
  local tag=$1; shift
  env "$@" timeout 150 python3 bench/mixed_step.py --decodes 12 --context 3000 --prompt 3000 --chunks 0,500 \
    --capture-tokens 512 --steps 10 --out "$LOGS/mixed_$tag.json" > "$LOGS/mixed_$tag.log" 2>&1
  echo "mixed $tag rc=$?"; tail -5 "$LOGS/mixed_$tag.log"; pack
}

variants() {  # variants TAG KEYS:STAGES... -- ARGS...: bench/attention_prefill.py, the Gluon kernel at each keys x stages
  # beside the Triton kernel in the same process (its max|diff| row checks the Gluon output)
  local tag=$1; shift; local list=(); while [ "$1" != "--" ]; do list+=("$1"); shift; done; shift
  for ks in "${list[@]}"; do
    INFER_CUDA_GLUON_PREFILL_KEYS=${ks%:*} INFER_CUDA_GLUON_PREFILL_STAGES=${ks#*:} timeout 60 \
      python3 bench/attention_prefill.py --no-sdpa --configs default triton "$@" \
      > "$LOGS/attention_${tag}_${ks/:/-}.log" 2>&1
    echo "gluon $ks rc=$?"; grep -E " (default|triton) " "$LOGS/attention_${tag}_${ks/:/-}.log"; pack
  done
}

case ${CALL:-gluon} in
  gluon)  # call 1 (a6bbc6b + the kernel at 128 keys, 2 stages, on by default then)
    export INFER_CUDA_GLUON_PREFILL=1  # 'default' runs the Gluon kernel; the mixed steps below set it each way
    gpu_tests gluon 150 tests/backend_cuda/test_attention_prefill_gluon.py tests/backend_cuda/test_attention.py \
      -k "gluon or prefill or mixed"
    timeout 120 python3 bench/attention_prefill.py --tokens 3072 --chunks 512 1024 3072 --no-sdpa \
      --configs default triton > "$LOGS/attention_3k.log" 2>&1
    echo "attention 3k rc=$?"; tail -8 "$LOGS/attention_3k.log"; pack
    INFER_CUDA_GLUON_PREFILL_KEYS=64 timeout 100 python3 bench/attention_prefill.py --tokens 3072 --chunks 512 3072 \
      --no-sdpa --configs default > "$LOGS/attention_3k_keys64.log" 2>&1
    echo "attention 3k keys64 rc=$?"; tail -3 "$LOGS/attention_3k_keys64.log"; pack
    timeout 120 python3 bench/attention_prefill.py --chunks 16384 2048 --configs default triton \
      --sdpa-backends cudnn > "$LOGS/attention_16k.log" 2>&1
    echo "attention 16k rc=$?"; tail -10 "$LOGS/attention_16k.log"; pack
    mixed_step gluon INFER_CUDA_GLUON_PREFILL=1
    mixed_step triton INFER_CUDA_GLUON_PREFILL=0 ;;
  stages)  # call 2: copies issued STAGES - 1 iterations ahead, at 64 and 128 keys
    export INFER_CUDA_GLUON_PREFILL=1  # 'default' runs the Gluon kernel (off by default since call 1)
    variants 3k 128:3 64:4 128:2 -- --tokens 3072 --chunks 512 3072
    variants 16k 128:3 -- --tokens 16384 --chunks 16384
    INFER_CUDA_GLUON_PREFILL_STAGES=3 gpu_tests stages3 90 tests/backend_cuda/test_attention_prefill_gluon.py ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
