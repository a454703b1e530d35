#!/usr/bin/env bash
# Thirty-sixth session's device calls (docs/benchmarks.md, "Thirty-sixth device session").
#   CALL=auto: on an H200, CALL=h200 (device_lib's `h200_served`, ~8 min) then CALL=$OTHER; elsewhere CALL=$OTHER.
#   CALL=rows (~4 min): the skinny GEMM's row-wise accumulators against its 3D product, kernel by kernel
#           (packages/infer-backend-cuda/scripts/bench_skinny_rowwise.py), then the BF16 decode step at 1-2 rows with INFER_CUDA_SKINNY_ROWWISE 0 / 1,
#           interleaved twice.
#   CALL=tune (~6 min): bench_skinny_gemm.py --rowwise at MS rows (default 1,2; linear, add_rms_norm_linear; TUNE_S
#           s) into the installed table, then device_lib's `tables_ab` (the installed table against the tree's) there.
#   CALL=entries_ab (~2.5 min): the BF16 step at 1-2 rows on the tree's tables against the same with the skinny table
#           before this session's row-wise entries (bench/results/h100_session36/skinny_gemm_before.json), interleaved
#           twice (device_lib's `configs_ab`); then CALL=$NEXT when set.
#   CALL=fp8 (~8 min): the FP8 kernels' GPU tests, then bench/tune_in_model.py --scheme fp8 (one row; the row-streaming
#           kernel's one-row forms are new candidates) into the installed tables (TUNE_S s), then `tables_ab` at one row.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh;
#   CALL=rows COMMIT=abc1234 bash scripts/device_session36.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, h200_then, roofline, switch_ab, ...
session_logs s36

case ${CALL:-auto} in
  auto | h200) h200_then "$0" "${OTHER:-rows}" ;;
  rows)
    timeout 300 python3 "$SCRIPTS/bench_skinny_rowwise.py" --json "$LOGS/rowwise.json" > "$LOGS/rowwise.log" 2>&1
    echo "rowwise rc=$?"; cat "$LOGS/rowwise.log"; pack
    switch_ab bf16_rowwise qwen3-4b 1,2 INFER_CUDA_SKINNY_ROWWISE ;;
  ab) switch_ab bf16_rowwise qwen3-4b "${BATCHES:-1,2}" INFER_CUDA_SKINNY_ROWWISE ;;
  entries_ab)
    before=$LOGS/configs_before; mkdir -p "$before"; cp "$TREE_CONFIGS"/*.json "$before/"
    cp bench/results/h100_session36/skinny_gemm_before.json "$before/skinny_gemm.json"
    configs_ab bf16_entries qwen3-4b "${BATCHES:-1,2}" "$TREE_CONFIGS" "$before" after before
    if [ -n "${NEXT:-}" ]; then CALL=$NEXT bash "$0"; fi ;;
  tune)
    table=$(installed_table skinny_gemm)
    timeout $(( ${TUNE_S:-270} + 60 )) python3 "$SCRIPTS/bench_skinny_gemm.py" --rowwise --ms "${MS:-1,2}" \
      --budget-s "${TUNE_S:-270}" --json "$LOGS/tune.json" --table "$table" > "$LOGS/tune.log" 2>&1
    echo "tune rc=$?"; grep -A30 "^ *op  *m" "$LOGS/tune.log"; cp "$table" "$LOGS/skinny_gemm.json"; pack
    tables_ab bf16 qwen3-4b "${MS:-1,2}" ;;
  fp8)
    gpu_tests fp8 150 tests/backend_cuda/test_quant_gemm.py tests/bench/test_tune_in_model.py -k fp8
    tune_in_model fp8 qwen3-4b-fp8 "${TUNE_S:-300}"
    tables_ab fp8 qwen3-4b-fp8 1 ;;
  *) echo "unknown CALL=$CALL"; exit 2 ;;
esac
