#!/usr/bin/env bash
# One device call over kernel-level parts, each bounded, the logs packed into $OUT/kernels.tar.gz after every part
# (so a cut run still returns what finished):
#   PARTS="tests roofline:qwen3-4b:1,64 roofline:qwen3-4b:256:640 prefill:qwen3-4b gdn qgemm:awq:1,8 skinny:qwen3.5-4b:1,2"
# tests                      GPU tests ($TESTS, bounded by TEST_TIMEOUT)
# roofline:MODEL:BATCHES[:CTX]  bench/decode_roofline.py with a kernel profile per batch (context CTX, default 256)
# prefill:MODEL              bench/prefill_profile.py: one 16k prompt in two 8k chunks, kernels ranked
# gdn                        packages/infer-backend-cuda/scripts/bench_gdn.py
# qgemm:FORMAT:MS            bench_quant_gemm.py for one format at these row counts
# skinny:MODEL:MS            bench_skinny_gemm.py tuning of the model's shapes (the table lands in $LOGS to commit)
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; PARTS=... bash scripts/device_kernels.sh
# COMMIT: name the tree from the machine that holds it (COMMIT=abc1234 ...): the device's copy of .git can be older
# than the tree it runs (seen 2026-12-02: every call printed the session's first commit).
set -u
OUT=${OUT:-/tmp/out}; LOGS=$OUT/kernels; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SCRIPTS=packages/infer-backend-cuda/scripts
echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$LOGS/commit.txt"
TESTS=${TESTS:-tests/backend_cuda/test_quant_gemm.py tests/backend_cuda/test_gated_delta.py
  tests/gpu/test_logits_processing_cuda.py tests/gpu/test_structured_cuda.py tests/gpu/test_quantized_cuda_matches_cpu.py
  tests/gpu/test_qwen3_5_cuda.py}

for part in ${PARTS:-tests}; do
  IFS=: read -r -a a <<< "$part"
  tag=$(echo "$part" | tr ':,' '__')
  case ${a[0]} in
    tests)
      timeout -s INT "${TEST_TIMEOUT:-170}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $TESTS \
        > "$LOGS/pytest_gpu.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_gpu.log" | tail -12 ;;
    roofline)
      timeout "${ROOFLINE_TIMEOUT:-75}" python3 bench/decode_roofline.py --model-dir "bench/models/${a[1]}" \
        --batches "${a[2]}" --context "${a[3]:-256}" --eager-batches "" --steps 20 --profile --profile-steps 3 \
        --out "$LOGS/$tag.json" > "$LOGS/$tag.log" 2>&1
      echo "$tag rc=$?"; grep -vE "^\s*$" "$LOGS/$tag.log" | tail -"${ROOFLINE_TAIL:-40}" ;;
    prefill)
      timeout "${PROFILE_TIMEOUT:-60}" python3 bench/prefill_profile.py --model-dir "bench/models/${a[1]}" \
        --tokens 16384 --chunk 8192 --top 12 --out "$LOGS/$tag.json" > "$LOGS/$tag.log" 2>&1
      echo "$tag rc=$?"; grep -A14 "^prefill of" "$LOGS/$tag.log" ;;
    gdn)
      timeout "${GDN_TIMEOUT:-50}" python3 "$SCRIPTS/bench_gdn.py" > "$LOGS/$tag.log" 2>&1
      echo "$tag rc=$?"; tail -20 "$LOGS/$tag.log" ;;
    qgemm)
      timeout "${QGEMM_TIMEOUT:-45}" python3 "$SCRIPTS/bench_quant_gemm.py" --budget-s $(( ${QGEMM_TIMEOUT:-45} - 8 )) \
        --formats "${a[1]}" --ms "${a[2]}" --json "$LOGS/$tag.json" > "$LOGS/$tag.log" 2>&1
      echo "$tag rc=$?"; tail -20 "$LOGS/$tag.log" ;;
    skinny)
      cp "$SCRIPTS/../src/infer_backend_cuda/configs/skinny_gemm.json" "$LOGS/skinny_gemm.json"
      timeout "${SKINNY_TIMEOUT:-150}" python3 "$SCRIPTS/bench_skinny_gemm.py" --model "${a[1]}" --ms "${a[2]}" \
        --budget-s $(( ${SKINNY_TIMEOUT:-150} - 15 )) --table "$LOGS/skinny_gemm.json" --json "$LOGS/$tag.json" \
        > "$LOGS/$tag.log" 2>&1
      echo "$tag rc=$?"; tail -22 "$LOGS/$tag.log" ;;
    *) echo "unknown part $part" ;;
  esac
  tar -czf "$OUT/kernels.tar.gz" -C "$OUT" kernels
done
tar -czf "$OUT/kernels.tar.gz" -C "$OUT" kernels && rm -rf "$LOGS"
