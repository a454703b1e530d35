#!/usr/bin/env bash
# One device call: the GPU tests (the second wave's new modules first, so that a time-out loses the old ones),
# then the decode roofline for the quantized and hybrid shapes, a profile of a 16k prefill, the vision tower and
# the grammar mask. Everything lands in $OUT/wave2.tar.gz
# (the device returns at most 8 files).
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; bash scripts/device_wave2_check.sh
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$LOGS/commit.txt"
first="tests/gpu/test_qwen3_5_cuda.py tests/gpu/test_qwen3_5_images_cuda.py tests/gpu/test_vision_cuda.py
  tests/gpu/test_structured_cuda.py tests/backend_cuda/test_gated_delta.py tests/backend_cuda/test_partial_rotary_attention.py
  tests/backend_cuda/test_quant_gemm.py tests/gpu/test_quantized_cuda_matches_cpu.py tests/gpu/test_device_fault_cuda.py"
rest=$(ls tests/gpu/test_*.py tests/backend_cuda/test_*.py | grep -v -F -x -f <(echo $first | tr ' ' '\n'))
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=25 \
  --junitxml="$LOGS/junit.xml" $first $rest > "$LOGS/pytest_gpu.log" 2>&1
echo "pytest rc=$?" | tee -a "$LOGS/pytest_gpu.log"
grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_gpu.log" | tail -40
for m in ${ROOFLINE_MODELS:-qwen3-4b-awq qwen3-4b-fp8 qwen3.5-4b}; do
  timeout "${BENCH_TIMEOUT:-70}" python3 bench/decode_roofline.py --model-dir "bench/models/$m" --batches 1,32 \
    --eager-batches "" --steps 20 --out "$LOGS/roofline_$m.json" > "$LOGS/roofline_$m.log" 2>&1
  echo "roofline $m rc=$?"; tail -6 "$LOGS/roofline_$m.log"
done
for m in ${PROFILE_MODELS:-qwen3.5-4b qwen3-4b}; do  # where a 16k prefill's time goes (issues 14, 16)
  timeout "${PROFILE_TIMEOUT:-90}" python3 bench/prefill_profile.py --model-dir "bench/models/$m" --tokens 16384 \
    --chunk 8192 --out "$LOGS/prefill_profile_$m.json" > "$LOGS/prefill_profile_$m.log" 2>&1
  echo "prefill profile $m rc=$?"; grep -A12 "^prefill of" "$LOGS/prefill_profile_$m.log"
done
timeout "${TOWER_TIMEOUT:-45}" python3 bench/vision_tower.py --sizes 448,1024 > "$LOGS/vision_tower.log" 2>&1
echo "vision_tower rc=$?"; tail -3 "$LOGS/vision_tower.log"
timeout "${MASK_TIMEOUT:-50}" python3 bench/structured_batch.py --mask-microbench --device cuda \
  --tokenizer-dir .bench-models/qwen3-4b-dummy --out "$LOGS/mask.json" > "$LOGS/mask.log" 2>&1
echo "mask rc=$?"; tail -2 "$LOGS/mask.log"
tar -czf "$OUT/wave2.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
