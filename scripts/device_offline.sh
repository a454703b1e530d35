#!/usr/bin/env bash
# One device call: start the CUDA engine, run the offline workloads (with the per-step host budget), stop it.
# CLIENTS (default 4): client processes; one Python client with 256 connections is CPU-bound and sets the pace.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_offline.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_engine.sh"
timeout 150 python3 bench/offline_throughput.py --model qwen3-4b --input-len 512 --output-len 256 --host-budget \
  --clients "${CLIENTS:-4}" \
  --out "$OUT/offline_512_256.json" | tail -22
if [ "${NANOVLLM:-1}" = 1 ]; then
  timeout 150 python3 bench/offline_throughput.py --model qwen3-4b --host-budget --clients "${CLIENTS:-4}" \
    --out "$OUT/offline_nanovllm.json" | tail -22
fi
kill -TERM $ENGINE_PID; wait $ENGINE_PID; echo "serve rc=$?"
tail -5 "$OUT/serve.log"
