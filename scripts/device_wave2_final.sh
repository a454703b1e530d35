#!/usr/bin/env bash
# One device call after a round of kernel changes: their GPU tests first, then each kernel alone (prefill attention,
# the quantized decode GEMMs through the decode roofline, a 16k hybrid prefill profile), then two engines: BF16
# (chat sweep, one 16k prompt, structured outputs at batch 64, offline) and Qwen3.5-4B with its vision tower (chat
# sweep, a quarter-image sweep, one 16k prompt).
# Each part is bounded by its own timeout and can be left out (TESTS="", ROOFLINE_MODELS="", QWEN35=0, ...).
# Logs and JSON go to $OUT/final.tar.gz (the device returns at most 8 files).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_wave2_final.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/final; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
DURATION=${DURATION:-15}; COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
URL=http://127.0.0.1:8000
source "$(dirname "$0")/device_lib.sh"  # model_dir, engine_up, engine_down, sweep, ttft_16k
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
echo "$COMMIT" | tee "$LOGS/commit.txt"

TESTS=${TESTS-tests/backend_cuda/test_attention.py tests/backend_cuda/test_gated_delta.py
  tests/backend_cuda/test_quant_gemm.py tests/backend_cuda/test_kernel_variants.py tests/gpu/test_qwen3_5_cuda.py
  tests/gpu/test_structured_cuda.py tests/gpu/test_quantized_cuda_matches_cpu.py tests/gpu/test_cuda_matches_cpu.py}
if [ -n "$TESTS" ]; then
  timeout -s INT "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $TESTS \
    > "$LOGS/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_gpu.log" | tail -20
fi
if [ "${ATTENTION:-1}" = 1 ]; then
  timeout "${ATTENTION_TIMEOUT:-50}" python3 bench/attention_prefill.py > "$LOGS/attention_prefill.log" 2>&1
  echo "attention_prefill rc=$?"; tail -14 "$LOGS/attention_prefill.log"
fi
for m in ${ROOFLINE_MODELS-qwen3-4b-awq qwen3-4b-fp8}; do
  extra=$(grep -q -- "--profile" bench/decode_roofline.py && echo --profile)
  timeout "${BENCH_TIMEOUT:-45}" python3 bench/decode_roofline.py --model-dir "bench/models/$m" --batches 1,32 \
    --eager-batches "" --steps 20 $extra --out "$LOGS/roofline_$m.json" > "$LOGS/roofline_$m.log" 2>&1
  echo "roofline $m rc=$?"; tail -18 "$LOGS/roofline_$m.log"
done
if [ "${LONG_DECODE:-1}" = 1 ]; then  # issue 14: decode at batch 32 with 16k of context per sequence
  timeout 60 python3 bench/decode_roofline.py --model-dir bench/models/qwen3-4b --batches 32 --context 16384 \
    --eager-batches "" --steps 20 --out "$LOGS/roofline_long.json" > "$LOGS/roofline_long.log" 2>&1
  echo "roofline 16k context rc=$?"; tail -3 "$LOGS/roofline_long.log"
fi
for b in ${KERNEL_BENCHES-}; do  # e.g. "bench_gdn bench_quant_gemm" (packages/infer-backend-cuda/scripts)
  timeout "${BENCH_TIMEOUT:-45}" python3 "packages/infer-backend-cuda/scripts/$b.py" > "$LOGS/$b.log" 2>&1
  echo "$b rc=$?"; tail -20 "$LOGS/$b.log"
done
for m in ${PROFILE_MODELS-qwen3.5-4b}; do
  timeout "${PROFILE_TIMEOUT:-60}" python3 bench/prefill_profile.py --model-dir "bench/models/$m" --tokens 16384 \
    --chunk 8192 --top 12 --out "$LOGS/prefill_profile_$m.json" > "$LOGS/prefill_profile_$m.log" 2>&1
  echo "prefill profile $m rc=$?"; grep -A12 "^prefill of" "$LOGS/prefill_profile_$m.log"
done
if [ "${BF16:-1}" = 1 ] && engine_up bf16 RUSTINFER_MAX_MODEL_LEN=32768; then
  sweep bf16_chat "${BF16_QPS:-1,32}"
  [ -n "${BF16_LONG_QPS-}" ] && sweep bf16_long "$BF16_LONG_QPS" --workload long
  ttft_16k bf16
  timeout 90 python3 bench/structured_batch.py --url $URL --model qwen3-4b --repeats 2 --out "$LOGS/structured.json" \
    > "$LOGS/structured.log" 2>&1; echo "structured rc=$?"; tail -7 "$LOGS/structured.log"
  if [ "${OFFLINE:-1}" = 1 ]; then
    timeout 90 python3 bench/offline_throughput.py --url $URL --model qwen3-4b --num-seqs 256 --input-len 512 \
      --output-len 256 --vocab 150000 --out "$LOGS/offline.json" > "$LOGS/offline.log" 2>&1
    echo "offline rc=$?"; tail -4 "$LOGS/offline.log"
  fi
  engine_down bf16
fi
for q in ${QUANT_FORMATS-}; do  # e.g. "awq fp8": each quantized dummy's chat sweep
  if engine_up $q RUSTINFER_MODEL="$(model_dir qwen3-4b-$q)"; then sweep ${q}_chat "${QUANT_QPS:-1,32}"; engine_down $q; fi
done
# With its vision tower (bench/models/qwen3.5-4b-vl/README.md): text chat, then a quarter of the requests with an
# image at qps 1, 4 and 16 (issue 17), then one 16k prompt.
dir=$(model_dir qwen3.5-4b-vl); cp bench/models/qwen3.5-4b-vl/{preprocessor_config.json,chat_template.jinja} "$dir/"
if [ "${QWEN35:-1}" = 1 ] && engine_up qwen35 RUSTINFER_MODEL="$dir" RUSTINFER_MAX_MODEL_LEN=32768; then
  sweep qwen35_chat "${QWEN35_QPS:-1,8}"
  [ -n "${IMAGE_QPS-1,4,16}" ] && sweep qwen35_images "${IMAGE_QPS-1,4,16}" --image-fraction 0.25 --image-side 1024
  ttft_16k qwen35
  engine_down qwen35
fi
tar -czf "$OUT/final.tar.gz" -C "$OUT" final && rm -rf "$LOGS"
