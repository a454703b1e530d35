#!/usr/bin/env bash
# The thirtieth session's device calls, each part bounded, the logs packed into $OUT/s30.tar.gz after every part.
#   CALL=auto: on an H200, mode 3's GPU tests, then device_session29.sh's CALL=h200 (the mid GEMM tuned for the H200, then served chat: base
#           at qps 1 and 32, streams3 and old at 32); on another GPU, CALL=$OTHER (default gpu).
#   CALL=mode3: the mixed step split by rows with the decode kernel forked (INFER_CUDA_MIXED_ATTENTION_STREAMS=3):
#           its GPU test, the profile of base (mode 2) against streams3, then served chat at qps 32 on both. The
#           traces (`--trace-dir`) showed mode 2's decode kernel, launched early under PDL, taking every SM, the
#           side's prefill starting 50 us into the 81 us kernel and the join 8 us after it: 90 us a layer against the
#           decode graph's 73. Predicted: mode 3 ~78-82 us a layer, the mixed step -0.3 to -0.4 ms (H100).
#   CALL=gpu: `pytest -m gpu tests/gpu` (CUDA == CPU greedy and the served paths) under the twenty-ninth session's new
#           defaults, then CALL=profile.
#   CALL=profile: the chat-shape mixed step (96 decodes at 400 tokens, a 32-token chunk) beside its decode graph, both
#           profiled (kernels ranked, chrome traces summarised as device timelines: `bench/mixed_step.py --profile 0,32
#           --trace-dir`): where the bounded, split step's ~0.5 ms over the decode graph goes, idle waits at the
#           graph's fork / join or kernels stretched by sharing the SMs. SPECS: base (the defaults), streams0 (one
#           stream), pdl0 (the WS prefill attention without PDL), b4 (bound 4).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=auto COMMIT=abc1234 bash scripts/device_session30.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, gpu_tests, tune_mid_unless_tuned
session_logs s30

case ${CALL:-auto} in
  auto)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      gpu_tests mode3 "${TEST_S:-90}" tests/backend_cuda/test_mixed_rope_attention.py
      OUT=$OUT CALL=h200 COMMIT=$COMMIT DURATION=${DURATION:-20} SERVED_SPECS="${SERVED_SPECS:-base streams3 old}" \
        LEVELS=${LEVELS:-32} bash "$(dirname "$0")/device_session29.sh"
    else
      CALL=${OTHER:-gpu} bash "$0"
    fi ;;
  gpu)
    gpu_tests tests_gpu "${TEST_S:-240}" tests/gpu
    CALL=profile bash "$0" ;;
  mode3)
    gpu_tests mode3 "${TEST_S:-90}" tests/backend_cuda/test_mixed_rope_attention.py
    SPECS="base streams3" CALL=profile bash "$0"
    OUT=$OUT SERVED_SPECS="${SERVED_SPECS:-base streams3}" LEVELS=32 BASE_LEVELS=32 COMMIT=$COMMIT \
      DURATION=${DURATION:-20} CALL=served bash "$(dirname "$0")/device_session29.sh" ;;
  profile)
    for spec in ${SPECS:-base streams0 pdl0}; do
      extra=(); bound=8
      case $spec in pdl0) extra+=(INFER_CUDA_WS_PREFILL_PDL=0) ;; b4) bound=4 ;;
                    streams*) extra+=("INFER_CUDA_MIXED_ATTENTION_STREAMS=${spec#streams}") ;; esac
      env "${extra[@]}" timeout "${RUN_S:-120}" python3 bench/mixed_step.py \
        --model-dir bench/models/qwen3-4b --decodes 96 --context 400 --prompt 192 --chunks "${CHUNKS:-0,32}" \
        --chunk-seqs $bound --capture-tokens 64,128,256,512 --steps "${STEPS:-20}" \
        --profile "${PROFILE:-0,32}" --trace-dir "$LOGS/trace_$spec" --out "$LOGS/$spec.json" > "$LOGS/$spec.log" 2>&1
      echo "mixed_step $spec rc=$?"; grep -E "device timeline|^ *chunk *tokens" -A3 "$LOGS/$spec.log"; pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
