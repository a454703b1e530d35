#!/usr/bin/env bash
# The thirteenth session's device calls, each part bounded, the logs packed into $OUT/s13.tar.gz after every part.
#   CALL=1: the one-launch GDN decode mixer (`kernels/gdn_decode.py`: value-block programs, the group's last arrival
#           shifting the q / k conv state and applying the gated norm) and the output gate in the decode attention:
#           their GPU tests, then the Qwen3.5-4B decode replay at 1 / 2 / 4 / 8 rows with the mixer fused and not
#           (INFER_CUDA_GDN_FUSED_DECODE=1 / 0), and both at one row without PDL (true kernel times).
#   CALL=2: the mixer's state tile (and the rows, slots, gate parameters) loaded before `gdc_wait`, the fused mixer
#           the default: the GPU tests (the gate's, Qwen3.5 CUDA == CPU and graph == eager), the Qwen3.5-4B replays
#           at 1-64 rows with 32-column value blocks (the default) and 16 (INFER_CUDA_GDN_BLOCK_V=16), and the three
#           kernels' at 1 / 32 / 64 (INFER_CUDA_GDN_FUSED_DECODE=0).
#   CALL=3: the skinny GEMM's weight prefetch in model at one row: the installed table as committed, then with every
#           one-row linear entry prefetching one tile ahead, then two (`prefetch` 1 / 2; the table restored after),
#           Qwen3.5-4B and Qwen3-4B batch-1 replays for each (ran at 58d6179; both depths slower, the two-tile form
#           removed after: a depth of 2 now runs as 1); then Qwen3.5-4B chat at qps 1 / 8 / 32 with the
#           committed defaults (issue 16: 0 failures).
#   CALL=4: loads moved above the kernels' first store (the GDN mixer's a / b; the RMSNorm's weight, also before
#           `gdc_wait`): their GPU tests, then the batch-1 replays, three runs of Qwen3.5-4B, two of Qwen3-4B and one of
#           Qwen3.5-4B with the three-kernel mixer.
#   CALL=5: the decode attention's step inputs and constants (lengths, position, slot, rotary row, q / k norm weights)
#           loaded before `gdc_wait`, the owner's v with its k: GPU tests (attention, CUDA == CPU), then Qwen3-4B
#           replays at 1 / 8 / 64 rows (three runs at one row) and Qwen3.5-4B at one row (two runs).
#   CALL=next: what this session left unmeasured, for the next one's first call: Qwen3-4B BF16 chat at qps 1 / 32
#           with the decode attention's early loads (a2f4381 on), and the Qwen3-4B replays at 1-8 rows.
#   CALL=awq: the twelfth session's plan for AWQ under load (not run): its GEMMs tuned at 32 / 64 rows into the
#           installed table, the AWQ replay at 32 / 64 rows, AWQ chat at qps 8 / 32; FP8 at 1-8 rows, chat qps 1 / 8.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session13.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, tune_table, roofline, gpu_tests
session_logs s13

one_row_prefetch() {  # one_row_prefetch TABLE DEPTH: this GPU's one-row linear entries set to prefetch DEPTH tiles
  python3 - "$1" "$2" <<'PY'
import json, sys
from pathlib import Path
import torch
from infer_backend_cuda.kernels import tuned_table
path, depth = Path(sys.argv[1]), int(sys.argv[2])
table = json.loads(path.read_text())
for e in table[torch.cuda.get_device_name()]:
    if e.get("op", "linear") == "linear" and e["m"] == 1 and e["use"]:
        e["prefetch"] = depth
path.write_text(tuned_table.dumps(table))
PY
}

case ${CALL:-1} in
  1)
    # every test of the two kernel files on the GPU (the small shapes too: real concurrency for the arrivals)
    INFER_CUDA_GDN_FUSED_DECODE=1 timeout -s INT "${TEST_TIMEOUT:-150}" python3 -m pytest -m "gpu or not gpu" -q \
      -p no:cacheprovider -rfE tests/backend_cuda/test_gdn_decode.py tests/backend_cuda/test_fused_decode_attention.py \
      tests/gpu/test_qwen3_5_cuda.py > "$LOGS/pytest_mixer.log" 2>&1
    echo "pytest mixer rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_mixer.log" | tail -8; pack
    roofline roofline_q35_fused1 qwen3.5-4b "${BATCHES:-1,2,4,8}" INFER_CUDA_GDN_FUSED_DECODE=1
    roofline roofline_q35_fused0 qwen3.5-4b "${BATCHES:-1,2,4,8}" INFER_CUDA_GDN_FUSED_DECODE=0
    roofline roofline_q35_fused1_nopdl qwen3.5-4b 1 INFER_CUDA_GDN_FUSED_DECODE=1 INFER_CUDA_PDL=0
    roofline roofline_q35_fused0_nopdl qwen3.5-4b 1 INFER_CUDA_GDN_FUSED_DECODE=0 INFER_CUDA_PDL=0
    ;;
  2)
    timeout -s INT "${TEST_TIMEOUT:-150}" python3 -m pytest -m "gpu or not gpu" -q -p no:cacheprovider -rfE \
      tests/backend_cuda/test_gdn_decode.py tests/gpu/test_qwen3_5_cuda.py \
      tests/backend_cuda/test_fused_decode_attention.py -k "gdn or qwen3_5 or gate or port_op or large or cuda" \
      > "$LOGS/pytest_mixer2.log" 2>&1
    echo "pytest mixer2 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_mixer2.log" | tail -8; pack
    roofline roofline_q35_bv32 qwen3.5-4b "${BATCHES:-1,2,4,8,32,64}"
    roofline roofline_q35_bv16 qwen3.5-4b "${BATCHES:-1,2,4,8,32,64}" INFER_CUDA_GDN_BLOCK_V=16
    roofline roofline_q35_unfused qwen3.5-4b 1,32,64 INFER_CUDA_GDN_FUSED_DECODE=0
    ;;
  3)
    table=$(python3 -c "from infer_backend_cuda.kernels import skinny_gemm as S; print(S._TABLE)")
    cp "$table" "$LOGS/skinny_gemm_committed.json"
    for depth in committed 1 2; do
      [ "$depth" = committed ] || one_row_prefetch "$table" "$depth"
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q35_pf$depth" qwen3.5-4b 1
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_pf$depth" qwen3-4b 1
      cp "$LOGS/skinny_gemm_committed.json" "$table"
    done
    ENGINES=${ENGINES:-"qwen35:chat=1,8,32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
  4)
    timeout -s INT "${TEST_TIMEOUT:-90}" python3 -m pytest -m "gpu or not gpu" -q -p no:cacheprovider -rfE \
      tests/backend_cuda/test_gdn_decode.py tests/backend_cuda/test_norm_activation.py > "$LOGS/pytest_hoist.log" 2>&1
    echo "pytest hoist rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_hoist.log" | tail -8; pack
    for run in 1 2 3; do ROOFLINE_ARGS="--steps 40" roofline "roofline_q35_run$run" qwen3.5-4b 1; done
    for run in 1 2; do ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_run$run" qwen3-4b 1; done
    ROOFLINE_ARGS="--steps 40" roofline roofline_q35_unfused qwen3.5-4b 1 INFER_CUDA_GDN_FUSED_DECODE=0
    ;;
  5)
    timeout -s INT "${TEST_TIMEOUT:-120}" python3 -m pytest -m "gpu or not gpu" -q -p no:cacheprovider -rfE \
      tests/backend_cuda/test_fused_decode_attention.py tests/gpu/test_cuda_matches_cpu.py tests/gpu/test_qwen3_5_cuda.py \
      > "$LOGS/pytest_attn.log" 2>&1
    echo "pytest attn rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_attn.log" | tail -8; pack
    ROOFLINE_ARGS="--steps 40" roofline roofline_q3_attn_run1 qwen3-4b 1,8,64
    for run in 2 3; do ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_attn_run$run" qwen3-4b 1; done
    for run in 1 2; do ROOFLINE_ARGS="--steps 40" roofline "roofline_q35_attn_run$run" qwen3.5-4b 1; done
    ;;
  next)
    roofline roofline_q3_small qwen3-4b 1,2,4,8
    ENGINES=${ENGINES:-"bf16:chat=1,32"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT bash scripts/device_engines.sh
    ;;
  awq)
    tune_table awq "${MS:-32,64}" "${TUNE_S:-100}" quant_awq_wide
    roofline roofline_awq_wide qwen3-4b-awq 32,64
    roofline roofline_fp8_small qwen3-4b-fp8 1,2,4,8
    ENGINES=${ENGINES:-"awq:chat=8,32 fp8:chat=1,8"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
esac
pack
