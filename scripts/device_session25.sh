#!/usr/bin/env bash
# The twenty-fifth session's device calls, each part bounded, the logs packed into $OUT/s25.tar.gz after every part.
#   CALL=ws: the warp-specialised Gluon prefill attention (kernels/attention_prefill_ws.py): its GPU tests, then the
#           kernel against the Triton kernel's default tile (`triton`, same process) at the ~3,000-token workload's
#           chunks and on a 16k prompt (cuDNN's sdpa as the yardstick), then the 500-token step beside 12 decodes at
#           3k context with it (INFER_CUDA_WS_PREFILL=1) and without; 3 stages (Q in registers) beside 2 at 3k;
#           last the mixed step with twice the decode attention's split waves (its 12 decodes sit in a 16-row bucket).
#   (CALL=pingpong, the consumers taking turns at their MMAs, ran in the twenty-sixth session; removed with the variant)
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=ws COMMIT=abc1234 bash scripts/device_session25.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, gpu_tests, pack
session_logs s25

mixed_step() {  # mixed_step TAG [env assignments...]: the 3k workload's mixed step (12 decodes, a 500-token chunk)
  local tag=$1; shift
  env "$@" timeout 150 python3 bench/mixed_step.py --decodes 12 --context 3000 --prompt 3000 --chunks 0,500 \
    --capture-tokens 512 --steps 10 --out "$LOGS/mixed_$tag.json" > "$LOGS/mixed_$tag.log" 2>&1
  echo "mixed $tag rc=$?"; tail -5 "$LOGS/mixed_$tag.log"; pack
}

smoke() {  # smoke TAG: one case first, bounded: a kernel that deadlocks on its mbarriers must not eat the call
  timeout -k 5 -s INT 60 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/backend_cuda/test_attention_prefill_ws.py \
    -k "matches and case0 and dtype0" > "$LOGS/pytest_$1.log" 2>&1
  local rc=$?; echo "$1 rc=$rc"; tail -3 "$LOGS/pytest_$1.log"; pack; return $rc
}

case ${CALL:-ws} in
  ws)
    smoke smoke || exit 0
    gpu_tests ws 120 tests/backend_cuda/test_attention_prefill_ws.py
    for st in 2 3; do
      INFER_CUDA_WS_PREFILL=1 INFER_CUDA_WS_PREFILL_STAGES=$st timeout 100 python3 bench/attention_prefill.py \
        --tokens 3072 --chunks 512 3072 --no-sdpa --configs default triton > "$LOGS/attention_3k_$st.log" 2>&1
      echo "attention 3k stages $st rc=$?"; tail -8 "$LOGS/attention_3k_$st.log"; pack
    done
    INFER_CUDA_WS_PREFILL_STAGES=3 gpu_tests ws3 100 tests/backend_cuda/test_attention_prefill_ws.py -k "matches"
    INFER_CUDA_WS_PREFILL=1 timeout 120 python3 bench/attention_prefill.py --chunks 16384 2048 --configs default \
      triton --sdpa-backends cudnn > "$LOGS/attention_16k.log" 2>&1
    echo "attention 16k rc=$?"; tail -10 "$LOGS/attention_16k.log"; pack
    mixed_step ws INFER_CUDA_WS_PREFILL=1
    mixed_step triton INFER_CUDA_WS_PREFILL=0
    mixed_step ws_waves4 INFER_CUDA_WS_PREFILL=1 INFER_CUDA_DECODE_SPLIT_WAVES=4 ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
