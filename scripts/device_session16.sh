#!/usr/bin/env bash
# The sixteenth session's device calls, each part bounded, the logs packed into $OUT/s16.tar.gz after every part.
#   CALL=offline: where the offline run's wall time goes: the decode attention's registers as loaded (ptxas, at the
#           served shapes), the offline 256 x (512, 256) run plain (with the host budget) and streamed (`--timeline`:
#           the prompts' share and the decode steps' gap), then the batch-256 decode step at 640 tokens of context
#           with its kernels ranked.
#   CALL=spy: the offline run's processes sampled by py-spy (a wheel carried in .whl/): a cold run (new prompts, seed
#           SEED), then the same prompts again (prefix-cached: decode steps only) streamed with `--timeline`, with the
#           client, the HTTP servers, the scheduler and the worker each recorded (raw stacks, CPU-busy samples).
#   CALL=clients: the offline run from one client process and from four (`--clients`), on new prompts each (seeds
#           11-13: no prefix-cache hits), the last streamed (`--timeline`) with the engine's processes sampled by
#           py-spy, then its prompts again (cached: decode steps only).
#   CALL=final: the decode attention's key tile configs at served shapes (`bench_decode_splits.py --configs`, with
#           each variant's registers), then the offline runs from four client processes: 512 x 256 three times on new
#           prompts (seeds 21-23), nano-vllm's mixed lengths once.
#   CALL=stages: the decode attention at three pipeline stages (the new default): its GPU tests, decode replays at 64,
#           128 and 256 rows (512 tokens of context) with three stages and two (`INFER_CUDA_DECODE_STAGES`), then the
#           offline 512 x 256 from four client processes, three times on new prompts (seeds 31-33).
#   CALL=repeat: the offline 512 x 256 from four client processes five times on new prompts (seeds 41-45), each
#           reporting how late its last client process submitted.
#   CALL=tiles (prepared for the next session): the decode attention's key tile configs in the model
#           (`INFER_CUDA_DECODE_TILE`, the plain kernel's winners in call 5): decode replays at 32-256 rows,
#           context 512.
#   CALL=rope_tiles (prepared): the same configs in the served form alone (`bench_decode_splits.py --rope`: the fused
#           q/k norm + RoPE + store), at the served shapes, with each variant's registers (~1 min).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=offline COMMIT=abc1234 bash scripts/device_session16.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, roofline
session_logs s16
URL=http://127.0.0.1:8000
DURATION=${DURATION:-15}

offline() {  # offline TAG [offline_throughput.py args...]
  timeout 150 python3 bench/offline_throughput.py --model qwen3-4b --input-len 512 --output-len 256 \
    --out "$LOGS/offline_$1.json" "${@:2}" > "$LOGS/offline_$1.log" 2>&1
  echo "offline $1 rc=$?"; grep -v "^ *[]{}]" "$LOGS/offline_$1.log" | tail -30; pack
}

case ${CALL:-offline} in
  offline)
    timeout 120 python3 $SCRIPTS/bench_decode_splits.py --waves 2 --cases 64x384,128x384,256x640 --registers \
      > "$LOGS/decode_registers.log" 2>&1
    echo "decode_registers rc=$?"; cat "$LOGS/decode_registers.log"; pack
    engine_up offline || exit 1
    offline plain --host-budget
    offline timeline --timeline --warmup-seqs 0
    offline plain2 --warmup-seqs 0
    engine_down offline; pack
    ROOFLINE_ARGS="--context 640" roofline b256_ctx640 qwen3-4b 256 ;;
  spy)
    python3 -m zipfile -e .whl/py_spy-*.whl /tmp/pyspy && SPY=$(ls /tmp/pyspy/py_spy-*.data/scripts/py-spy) \
      && chmod +x "$SPY" && "$SPY" --version || exit 1
    engine_up spy || exit 1
    offline cold --seed "${SEED:-7}" --warmup-seqs 0
    for role in server scheduler worker; do
      for pid in $(pgrep -f "rustinfer-$role|infer_$role.cli|infer_$role "); do
        timeout 40 "$SPY" record -p "$pid" -d "${SPY_S:-9}" -r 200 -f raw -o "$LOGS/spy_${role}_$pid.txt" \
          > "$LOGS/spy_${role}_$pid.log" 2>&1 &
        SPIES="${SPIES:-} $!"
      done
    done
    sleep 1
    timeout 60 "$SPY" record -r 200 -f raw -o "$LOGS/spy_client.txt" -- python3 bench/offline_throughput.py \
      --model qwen3-4b --input-len 512 --output-len 256 --seed "${SEED:-7}" --warmup-seqs 0 --timeline \
      --out "$LOGS/offline_spy.json" > "$LOGS/offline_spy.log" 2>&1
    echo "offline spy rc=$?"; grep -v "^ *[]{}]" "$LOGS/offline_spy.log" | tail -20
    wait $SPIES; engine_down spy; pack ;;
  clients)
    python3 -m zipfile -e .whl/py_spy-*.whl /tmp/pyspy && SPY=$(ls /tmp/pyspy/py_spy-*.data/scripts/py-spy) \
      && chmod +x "$SPY" || exit 1
    engine_up clients || exit 1
    offline c1 --seed 11
    offline c4 --seed 12 --clients 4 --warmup-seqs 0
    SPIES=""
    for role in server scheduler worker; do
      for pid in $(pgrep -f "infer_$role.cli|rustinfer-$role"); do
        timeout 40 "$SPY" record -p "$pid" -d 12 -r 100 -f raw -o "$LOGS/spy_${role}_$pid.txt" \
          > "$LOGS/spy_${role}_$pid.log" 2>&1 &
        SPIES="$SPIES $!"
      done
    done
    ps aux | grep -i infer_ | grep -v grep | cut -c1-200 > "$LOGS/ps.txt"
    offline c4_timeline --seed 13 --clients 4 --warmup-seqs 0 --timeline
    [ -n "$SPIES" ] && wait $SPIES
    offline c4_cached --seed 13 --clients 4 --warmup-seqs 0 --timeline
    engine_down clients; pack ;;
  final)
    timeout 200 python3 $SCRIPTS/bench_decode_splits.py --cases 64x384,128x384,256x640,12x3000,32x1000 --registers \
      --configs 64:4:2,32:4:2,64:8:2,128:8:2,64:4:3,32:2:2,128:4:2 --json "$LOGS/decode_tiles.json" \
      > "$LOGS/decode_tiles.log" 2>&1
    echo "decode_tiles rc=$?"; cat "$LOGS/decode_tiles.log"; pack
    engine_up final || exit 1
    for seed in 21 22 23; do offline "c4_s$seed" --seed $seed --clients 4 --warmup-seqs $(( seed == 21 ? 64 : 0 )); done
    timeout 150 python3 bench/offline_throughput.py --model qwen3-4b --clients 4 --warmup-seqs 0 --seed 24 \
      --out "$LOGS/offline_nanovllm_c4.json" > "$LOGS/offline_nanovllm_c4.log" 2>&1
    echo "nanovllm rc=$?"; grep -v "^ *[]{}]" "$LOGS/offline_nanovllm_c4.log" | tail -12
    engine_down final; pack ;;
  stages)
    gpu_tests stages 150 tests/backend_cuda/test_attention.py tests/backend_cuda/test_fused_decode_attention.py \
      tests/backend_cuda/test_partial_rotary_attention.py tests/gpu/test_cuda_matches_cpu.py
    ROOFLINE_TIMEOUT=150 ROOFLINE_ARGS="--context 512" roofline stages3 qwen3-4b 64,128,256
    ROOFLINE_TIMEOUT=150 ROOFLINE_ARGS="--context 512" roofline stages2 qwen3-4b 64,128,256 INFER_CUDA_DECODE_STAGES=2
    engine_up stages || exit 1
    for seed in 31 32 33; do offline "c4_s$seed" --seed $seed --clients 4 --warmup-seqs $(( seed == 31 ? 64 : 0 )); done
    engine_down stages; pack ;;
  repeat)
    engine_up repeat || exit 1
    for seed in 41 42 43 44 45; do
      offline "c4_s$seed" --seed $seed --clients 4 --warmup-seqs $(( seed == 41 ? 64 : 0 ))
    done
    engine_down repeat; pack ;;
  rope_tiles)
    timeout 240 python3 $SCRIPTS/bench_decode_splits.py --rope --registers \
      --cases 32x1000,64x384,96x350,128x384,256x640,12x3000 \
      --configs 64:4:2,32:4:2,128:8:2,32:2:2,64:8:2,64:4:3 --json "$LOGS/rope_tiles.json" > "$LOGS/rope_tiles.log" 2>&1
    echo "rope_tiles rc=$?"; cat "$LOGS/rope_tiles.log"; pack ;;
  tiles)
    for tile in ${TILES:-64:4:2 32:4:2 128:8:2 32:2:2}; do
      ROOFLINE_TIMEOUT=150 ROOFLINE_ARGS="--context 512" roofline "tile_${tile//:/_}" qwen3-4b 32,64,128,256 \
        INFER_CUDA_DECODE_TILE="$tile"
    done ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
