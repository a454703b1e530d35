#!/usr/bin/env bash
# The seventeenth session's device calls, each part bounded, the logs packed into $OUT/s17.tar.gz after every part.
# CALL=fit and fit2 ran at 89452a9 and dde778e: the wave fit was dropped after them (docs/benchmarks.md,
# seventeenth session), so INFER_CUDA_DECODE_WAVE_FIT no longer exists and both now run the default twice.
#   CALL=fit: the decode attention's wave fit (`attention_decode.wave_fit`: the narrow 32:2:2 tile where it runs
#           the grid in one wave and 64:4:2 needs two): its GPU tests, decode replays at 64-128 rows (context 400)
#           with the fit and without (INFER_CUDA_DECODE_WAVE_FIT=0), then chat at qps 32 on an engine with it and
#           on one without.
#   CALL=gaps: chat at qps 1 (40 s) and 32 (20 s) with each request's timeline, the long gaps classed by cause.
#   CALL=gc: chat at qps 1 (40 s, timelines) with the worker's collector tuned and with Python's settings.
#   CALL=compiles: chat at qps 1 and 32 on a fresh machine, the worker's log of Triton compiles while serving.
#   CALL=next (prepared): CALL=compiles, then chat at qps 1 twice (40 s, timelines) and the offline run three times.
#   CALL=rows2 (prepared): replays at 1-4 rows with the 2-row step on the 4-row skinny configs and without.
#   CALL=fit2: that served A/B at qps 24 and 32 (DURATION s a level) with the host budget (`--host-budget`).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=fit COMMIT=abc1234 bash scripts/device_session17.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, engine_up, engine_down, sweep, roofline, gpu_tests
session_logs s17
URL=http://127.0.0.1:8000
DURATION=${DURATION:-15}

case ${CALL:-fit} in
  fit)
    gpu_tests fit 150 tests/backend_cuda/test_fused_decode_attention.py tests/backend_cuda/test_attention.py \
      -k "narrow or large or wave or resident"
    ROOFLINE_TIMEOUT=120 ROOFLINE_ARGS="--context 400" roofline fit_on qwen3-4b 64,80,96,128
    ROOFLINE_TIMEOUT=120 ROOFLINE_ARGS="--context 400" roofline fit_off qwen3-4b 64,80,96,128 \
      INFER_CUDA_DECODE_WAVE_FIT=0
    for fit in 1 0; do
      engine_up "fit$fit" RUSTINFER_MAX_MODEL_LEN=32768 INFER_CUDA_DECODE_WAVE_FIT=$fit || continue
      sweep "fit${fit}_chat" 32
      engine_down "fit$fit"; pack
    done ;;
  fit2)  # the served A/B again, levels where the batch sits in the 80- and 96-row graphs, with the host budget
    for fit in 1 0; do
      engine_up "fit2_$fit" RUSTINFER_MAX_MODEL_LEN=32768 INFER_CUDA_DECODE_WAVE_FIT=$fit || continue
      sweep "fit2_${fit}_chat" 24,32 --host-budget
      engine_down "fit2_$fit"; pack
    done ;;
  gaps)  # where the long inter-token gaps come from (`serve_sweep.py --timeline`, bench/itl_gaps.py): chat at
    # qps 1 for 40 s, then qps 32 for 20 s
    engine_up gaps RUSTINFER_MAX_MODEL_LEN=32768 || exit 1
    DURATION=40 sweep gaps_qps1 1 --timeline
    DURATION=20 sweep gaps_qps32 32 --timeline
    grep -h "gaps above" "$LOGS"/sweep_gaps_*.log
    engine_down gaps; pack ;;
  gc)  # the worker's collector tuned (the default now) against Python's settings (INFER_WORKER_GC=default): chat
    # at qps 1 for 40 s with the long gaps classed
    for gc in ${GCS:-tuned default}; do
      engine_up "gc_$gc" RUSTINFER_MAX_MODEL_LEN=32768 INFER_WORKER_GC=$gc || continue
      DURATION=40 sweep "gc_${gc}_qps1" 1 --timeline
      grep -h "gaps above" "$LOGS/sweep_gc_${gc}_qps1.log"
      engine_down "gc_$gc"; pack
    done ;;
  compiles)  # Triton compiles while serving (`compile_watch`: the worker logs each): chat at qps 1 then 32, 15 s
    engine_up compiles RUSTINFER_MAX_MODEL_LEN=32768 || exit 1
    sweep compiles_qps1 1; grep -c "compiled while serving" "$LOGS/serve_compiles.log"
    sweep compiles_qps32 32; grep "compiled while serving" "$LOGS/serve_compiles.log" | cut -c1-300 | head -30
    engine_down compiles; pack ;;
  next)  # prepared for the next session: the compile watch's log on a fresh machine (CALL=compiles), then on a
    # second engine chat at qps 1 twice (40 s, timelines: the qps-1 p99 with the worker's collector tuned, repeated)
    # and the offline 256 x (512, 256) from four client processes on new prompts three times
    CALL=compiles bash "$0"
    engine_up next RUSTINFER_MAX_MODEL_LEN=32768 || exit 1
    for i in 1 2; do DURATION=40 sweep "next_qps1_$i" 1 --timeline; grep -h "gaps above" "$LOGS/sweep_next_qps1_$i.log"; done
    for seed in 51 52 53; do
      timeout 150 python3 bench/offline_throughput.py --model qwen3-4b --input-len 512 --output-len 256 --clients 4 \
        --seed $seed --warmup-seqs $(( seed == 51 ? 64 : 0 )) --out "$LOGS/offline_s$seed.json" > "$LOGS/offline_s$seed.log" 2>&1
      echo "offline s$seed rc=$?"; grep -v "^ *[]{}]" "$LOGS/offline_s$seed.log" | tail -4
    done
    engine_down next; pack ;;
  rows2)  # the two-row step on the 4-row bucket's skinny configs (INFER_CUDA_SKINNY_ROW_BUCKETS=2:4) against the
    # table's, decode replays at 1-4 rows (context 400), the remapped run between two plain ones
    ROOFLINE_ARGS="--context 400" roofline rows_plain qwen3-4b 1,2,3,4
    ROOFLINE_ARGS="--context 400" roofline rows_2as4 qwen3-4b 1,2,3,4 INFER_CUDA_SKINNY_ROW_BUCKETS=2:4
    ROOFLINE_ARGS="--context 400" roofline rows_plain2 qwen3-4b 1,2,3,4 ;;
  *) echo "unknown CALL ${CALL}" ;;
esac
pack
