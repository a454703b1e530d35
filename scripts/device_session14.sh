#!/usr/bin/env bash
# The fourteenth session's device calls, each part bounded, the logs packed into $OUT/s14.tar.gz after every part.
#   CALL=1: the decode attention asking L2 for o_proj's weight (`kernels/l2_prefetch.py`) and loading its first key
#           tile's page ids before `gdc_wait`: the GPU tests (values unchanged with the prefetch after the wait and
#           before it; the large shapes; the skinny GEMM's split-K), then Qwen3-4B batch-1 replays with
#           INFER_CUDA_L2_PREFETCH=0 / 1 / early, each its own process, and 1-8 rows with the default.
#   CALL=ab: batch-1 at 1.54x of its floor after CALL=1 (1.36x at c79460f): the earlier commits' packages
#           (`variants/<commit>`, `git archive`, not committed) installed side by side and replayed in turn with
#           the head's, then CALL=2's tuning.
#   CALL=norm: the add+RMSNorm in the qkv / gate_up GEMM's prologue (the gate_up one with the SiLU-and-mul epilogue
#           too: `skinny_add_rms_norm_linear_silu_mul`), which the isolated tuner rejected at one row (0.5-2 us
#           slower alone) but which takes the norm kernel's hop off the PDL chain: the GPU tests, then Qwen3-4B
#           replays with the installed table and with variants of it (`table_variant`), each in turn twice.
#   CALL=rows: the 2-row step at 0.28 ms above the 1-row one (the same weight bytes): the 1-row configs (CUDA-core
#           products, the PDL chain unbroken) for 2 and 4 rows (`rows_variant`), all five Qwen3-4B GEMMs or only
#           o_proj / down (on cuBLAS there), replayed in turn with the installed table at 2 and 3 rows.
#   CALL=2: the skinny GEMM's split-K for o_proj and down at 2 / 4 / 8 rows (cuBLAS there so far): tuned into the
#           installed table (`bench_skinny_gemm.py --split`), then the Qwen3-4B replays at 1-8 rows with it.
# CALL=1 / ab / 2 ran at e8e24bc and CALL=norm at 8eafb26: what they measure was reverted after (docs/benchmarks.md,
# "Fourteenth device session"), so at later trees they run without it.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session14.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, tune_table, installed_table, roofline, gpu_tests
session_logs s14

variant_path() {  # variant_path COMMIT: that commit's packages installed under /tmp/v_COMMIT, first on the path
  [ -d "/tmp/v_$1" ] || for p in variants/$1/packages/*; do
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "/tmp/v_$1" "$p" \
      2>&1 | grep -i error | head -3
  done
  echo "PYTHONPATH=/tmp/v_$1:$PYTHONPATH"
}

table_variant() {  # table_variant NAME: the installed skinny table with the fused norm on, into $LOGS/table_NAME.json
  python3 - "$1" "$LOGS/table_$1.json" <<'PY'
import json, sys
from infer_backend_cuda.kernels import skinny_gemm as S
name, dest = sys.argv[1], sys.argv[2]
table = json.load(open(S._TABLE))
entries = table["NVIDIA H200"]
plain = {(e["m"], e["n"], e["k"]): e for e in entries if e["op"] == "linear"}
shapes = [(6144, 2560), (19456, 2560)]  # Qwen3-4B qkv, gate_up
rows = {"m1": [1], "m1plain": [1], "rows": [2, 4, 8]}[name]
for m in rows:
    for n, k in shapes:
        fused = [e for e in entries if e["op"] == "add_rms_norm_linear" and (e["m"], e["n"], e["k"]) == (m, n, k)]
        if name == "m1plain" or not fused:  # the plain GEMM's config (same weight stream)
            entries[:] = [e for e in entries if e not in fused]
            entries.append(dict(plain[(m, n, k)], op="add_rms_norm_linear", use=True))
        else:
            fused[0]["use"] = True
json.dump(table, open(dest, "w"), indent=1)
PY
}

with_table() {  # with_table FILE CMD...: CMD with FILE as the installed skinny table, the original restored after
  local table; table=$(installed_table skinny_gemm)
  cp "$table" /tmp/skinny_table.orig; cp "$1" "$table"; shift
  "$@"; cp /tmp/skinny_table.orig "$table"
}

rows_variant() {  # rows_variant NAME SHAPES M...: those rows' linear entries for SHAPES (n:k,...) set to the 1-row one
  python3 - "$LOGS/table_$1.json" "$2" "${@:3}" <<'PY'
import json, sys
from infer_backend_cuda.kernels import skinny_gemm as S
dest, shapes, rows = sys.argv[1], [tuple(map(int, s.split(":"))) for s in sys.argv[2].split(",")], sys.argv[3:]
table = json.load(open(S._TABLE))
entries = table["NVIDIA H200"]
one = {(e["n"], e["k"]): e for e in entries if e["op"] == "linear" and e["m"] == 1}
for m in map(int, rows):
    entries[:] = [e for e in entries if not (e["op"] == "linear" and e["m"] == m and (e["n"], e["k"]) in shapes)]
    entries.extend(dict(one[nk], m=m, use=True) for nk in shapes)
json.dump(table, open(dest, "w"), indent=1)
PY
}

case ${CALL:-1} in
  rows)
    all=6144:2560,19456:2560,2560:4096,2560:9728,151936:2560
    rows_variant all "$all" 2 4; rows_variant attn_mlp_out 2560:4096,2560:9728 2 4
    for run in 1 2; do
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_base23_$run" qwen3-4b 2,3
      for v in all attn_mlp_out; do
        ROOFLINE_ARGS="--steps 40" with_table "$LOGS/table_$v.json" roofline "roofline_q3_${v}23_$run" qwen3-4b 2,3
      done
    done
    ;;
  norm)
    gpu_tests norm "${TEST_TIMEOUT:-90}" tests/backend_cuda/test_skinny_gemm.py
    for v in m1 m1plain rows; do table_variant $v; done
    for run in 1 2; do
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_base_$run" qwen3-4b 1
      for v in m1 m1plain; do
        ROOFLINE_ARGS="--steps 40" with_table "$LOGS/table_$v.json" roofline "roofline_q3_${v}_$run" qwen3-4b 1
      done
    done
    ROOFLINE_ARGS="--steps 40" roofline roofline_q3_base_rows qwen3-4b 2,4,8
    ROOFLINE_ARGS="--steps 40" with_table "$LOGS/table_rows.json" roofline roofline_q3_rows_rows qwen3-4b 2,4,8
    ;;
  ab)
    for c in c79460f 940802e; do
      env "$(variant_path $c)" python3 -c "import infer_backend_cuda.kernels.skinny_gemm as m, inspect
print('$c:', m.__file__, 'split_k' in inspect.getsource(m))"
    done
    for run in 1 2; do
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_head_$run" qwen3-4b 1
      for c in c79460f 940802e; do
        ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_${c}_$run" qwen3-4b 1 "$(variant_path $c)"
      done
    done
    ROOFLINE_ARGS="--steps 40" roofline roofline_q3_c79460f_rows qwen3-4b 2,8 "$(variant_path c79460f)"
    CALL=2 TUNE_S=${TUNE_S:-140} bash "$0"
    ;;
  1)
    gpu_tests l2 "${TEST_TIMEOUT:-100}" tests/backend_cuda/test_fused_decode_attention.py \
      tests/backend_cuda/test_skinny_gemm.py -k "l2_prefetch or large or split or qwen3_shapes"
    for mode in 0 1 early; do
      ROOFLINE_ARGS="--steps 40" roofline "roofline_q3_l2_$mode" qwen3-4b 1 INFER_CUDA_L2_PREFETCH=$mode
    done
    ROOFLINE_ARGS="--steps 40" roofline roofline_q3_rows qwen3-4b 1,2,4,8
    ;;
  2)
    table=$(installed_table skinny_gemm)
    timeout 240 python3 "$SCRIPTS/bench_skinny_gemm.py" --split --ops linear --ms 2,4,8 --shapes o_proj,down \
      --budget-s "${TUNE_S:-170}" --json "$LOGS/tune_split.json" --table "$table" > "$LOGS/tune_split.log" 2>&1
    echo "tune rc=$?"; grep -A12 "^ *op " "$LOGS/tune_split.log"; cp "$table" "$LOGS/skinny_gemm_split.json"; pack
    ROOFLINE_ARGS="--steps 40" roofline roofline_q3_split qwen3-4b 1,2,4,8
    ;;
esac
pack
