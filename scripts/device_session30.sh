#!/usr/bin/env bash
# The thirtieth session's device calls, each part bounded, the logs packed into $OUT/s30.tar.gz after every part.
#   CALL=auto: on an H200, CALL=h200; on another GPU, CALL=$OTHER (default next).
#   CALL=next: what the session left for any GPU: the kernel-variant GPU tests (the reduce case changed, unrun), then
#           chat at qps 1 and 8 on the served config with the prefill attention's query-length rule (only qps 32 ran).
#   (calls 3 and 4 ran CALL=mode3: the split with the decode kernel forked, INFER_CUDA_MIXED_ATTENTION_STREAMS=3, its GPU
#   test, the profile against mode 2 and served chat at qps 32; removed with the mode after call 5, docs/benchmarks.md)
#   CALL=long3k: CALL=profile on the ~3k workload's mixed step (12 decodes at 3,000 tokens, a 500-token chunk), modes 0 / 2.
#   CALL=ws0: CALL=profile at the chat and the 3k shapes with the Triton prefill kernel (INFER_CUDA_WS_PREFILL=0) against WS.
#   CALL=wsabove: the prefill attention's query-length rule: GPU tests, then chat at qps 32 with and without it.
#   CALL=midall: decode replays with the mid GEMM on every tuned shape (INFER_CUDA_MID_GEMM_ALL=1) against the table.
#   CALL=gpu: `pytest -m gpu tests/gpu` (CUDA == CPU greedy and the served paths) under the twenty-ninth session's new
#           defaults, then CALL=profile.
#   CALL=profile: the chat-shape mixed step (96 decodes at 400 tokens, a 32-token chunk) beside its decode graph, both
#           profiled (kernels ranked, chrome traces summarised as device timelines: `bench/mixed_step.py --profile 0,32
#           --trace-dir`): where the bounded, split step's ~0.5 ms over the decode graph goes, idle waits at the
#           graph's fork / join or kernels stretched by sharing the SMs. SPECS: base (the defaults), streams0 (one
#           stream), pdl0 (the WS prefill attention without PDL), b4 (bound 4).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=auto COMMIT=abc1234 bash scripts/device_session30.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, sweep, gpu_tests, gpu_branch, h200_served, ...
session_logs s30

case ${CALL:-auto} in
  auto) CALL=$(gpu_branch) bash "$0" ;;
  h200)  # one call, ~8 min: the mid GEMM tuned where the table lacks this GPU (the 2-8-row o_proj / down on cuBLAS
    # there: the qps-1 p50's suspect), then on the served config with that table: chat at qps 1 and 32; the ~3,000-token
    # prompts at qps 4 with the 512-token cap (LONG_S s); chat at qps 32 with the twenty-ninth session's three
    # defaults off (old). Copy the returned mid_gemm.json into packages/infer-backend-cuda/src/infer_backend_cuda/configs/.
    h200_served
    if engine_up old RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_MIXED_GRAPH_CHUNK_SEQS=0 \
        INFER_CUDA_MIXED_ATTENTION_STREAMS=0 INFER_CUDA_DECODE_HEADS_FASTEST=0; then
      sweep old_chat 32; engine_down old; pack
    fi ;;
  long3k)  # the ~3k workload's mixed step (12 decodes at 3,000 tokens, a 500-token chunk: the 512-token graph) in modes
    # 0 and 2: there the prefill attention (~70 us a layer on the H200) is as long as the decode attention, so the
    # split on two streams can overlap more than at a chat chunk
    DECODES=12 CONTEXT=3000 PROMPT=3000 CHUNKS=0,500 PROFILE=500 SPECS="streams0 base" CALL=profile bash "$0" ;;
  next)
    gpu_tests variants "${TEST_S:-120}" tests/backend_cuda/test_kernel_variants.py
    if engine_up base RUSTINFER_MAX_MODEL_LEN=32768; then
      sweep base_chat "${LEVELS:-1,8}"; engine_down base; pack
    fi ;;
  ws0)  # the Triton prefill kernel (INFER_CUDA_WS_PREFILL=0) against the warp-specialised one in the mixed steps: at a
    # chat chunk the WS kernel's 8 working programs (one 128-row query tile a KV head, two key tiles) take 18 us alone
    # and 35-38 beside the decode kernel, ending after it (call 2's traces); a kernel with less set-up per program may
    # end sooner there. The 3k step (500-token chunk) as the check that WS stays where it won.
    SPECS="base ws0" PROFILE=32 CALL=profile bash "$0"
    PREFIX=long_ DECODES=12 CONTEXT=3000 PROMPT=3000 CHUNKS=0,500 PROFILE=500 SPECS="base ws0" CALL=profile bash "$0" ;;
  wsabove)  # the prefill attention's query-length rule (INFER_CUDA_WS_PREFILL_ABOVE, 256): its GPU tests, then chat at
    # qps 32 (DURATION s) with the rule (base) and with WS at every length (wsall, the rule before). Predicted: the
    # mixed steps of the 128 / 256-token graphs -0.05 to -0.23 ms (call 9), ITL p99 a little lower, p50 unchanged.
    gpu_tests wsabove "${TEST_S:-100}" tests/backend_cuda/test_attention_prefill_ws.py \
      tests/backend_cuda/test_kernel_variants.py tests/gpu/test_cuda_matches_cpu.py -k "not test_cuda_fp32_greedy_equals_cpu and not test_cuda_graph_replay_equals_eager"
    for spec in base wsall; do
      extra=(); [ "$spec" = wsall ] && extra+=(INFER_CUDA_WS_PREFILL_ABOVE=0)
      engine_up "$spec" RUSTINFER_MAX_MODEL_LEN=32768 "${extra[@]}" || continue
      sweep "${spec}_chat" 32; engine_down "$spec"; pack
    done ;;
  midall)  # the mid GEMM on every tuned shape (INFER_CUDA_MID_GEMM_ALL=1) against the table's choice, decode replays at
    # BATCHES (default 64,96,128), alternated RUNS times (default once): at 128 rows the H100's table leaves qkv / o_proj / down to cuBLAS,
    # which won alone by 0.2-0.5 us (qkv, down) and 3.3 (o_proj). Predicted: in the step the mid GEMM keeps the PDL
    # chain (~1-3 us a launch), -2 to -5 us a layer at 128 rows, unless o_proj's loss outweighs it.
    for run in $(seq "${RUNS:-1}"); do
      roofline "base$run" qwen3-4b "${BATCHES:-64,96,128}"
      roofline "all$run" qwen3-4b "${BATCHES:-64,96,128}" INFER_CUDA_MID_GEMM_ALL=1
    done ;;
  gpu)
    gpu_tests tests_gpu "${TEST_S:-240}" tests/gpu
    CALL=profile bash "$0" ;;
  profile)
    for spec in ${SPECS:-base streams0 pdl0}; do
      extra=(); bound=8
      case $spec in pdl0) extra+=(INFER_CUDA_WS_PREFILL_PDL=0) ;; b4) bound=4 ;; ws0) extra+=(INFER_CUDA_WS_PREFILL=0) ;;
                    streams*) extra+=("INFER_CUDA_MIXED_ATTENTION_STREAMS=${spec#streams}") ;; esac
      env "${extra[@]}" timeout "${RUN_S:-120}" python3 bench/mixed_step.py \
        --model-dir bench/models/qwen3-4b --decodes "${DECODES:-96}" --context "${CONTEXT:-400}" --prompt "${PROMPT:-192}" \
        --chunks "${CHUNKS:-0,32}" --chunk-seqs $bound --capture-tokens 64,128,256,512 --steps "${STEPS:-20}" \
        --profile "${PROFILE:-0,32}" --trace-dir "$LOGS/trace_${PREFIX:-}$spec" --out "$LOGS/${PREFIX:-}$spec.json" \
        > "$LOGS/${PREFIX:-}$spec.log" 2>&1
      echo "mixed_step ${PREFIX:-}$spec rc=$?"; grep -E "device timeline|^ *chunk *tokens" -A3 "$LOGS/${PREFIX:-}$spec.log"; pack
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
