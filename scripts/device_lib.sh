#!/usr/bin/env bash
# Sourced by the device sweep scripts (needs LOGS, URL, DURATION, COMMIT set): start and stop engines, run sweeps;
# the decode replays and GPU tests of the session scripts (they also need a `pack` function).

model_dir() {  # a checkpoint folder: the carried dummy's tokenizer with the named shape's config.json
  local dir=/tmp/models/$1; mkdir -p "$dir"; cp .bench-models/qwen3-4b-dummy/* "$dir/"; chmod u+w "$dir"/*
  cp "bench/models/$1/config.json" "$dir/config.json"; echo "$dir"
}

engine_up() {  # engine_up LABEL [RUSTINFER_X=... ...]: device_engine.sh with these overrides for this engine alone
  local kv
  for kv in "${@:2}"; do export "$kv"; done
  SERVE_LOG="$LOGS/serve_$1.log" source "$(dirname "${BASH_SOURCE[0]}")/device_engine.sh"
  for kv in "${@:2}"; do unset "${kv%%=*}"; done
  [ "$ENGINE_UP" = 1 ]  # the status: whether it serves
}

engine_down() {
  python3 -c "import httpx; print(httpx.get('$URL/metrics').text)" > "$LOGS/metrics_$1.txt" 2>&1
  kill -TERM $ENGINE_PID; wait $ENGINE_PID; echo "$1 serve rc=$?"; tail -3 "$LOGS/serve_$1.log"
}

sweep() {  # sweep LABEL QPS [serve_sweep args...]
  timeout "${SWEEP_TIMEOUT:-200}" python3 bench/serve_sweep.py --url $URL --model qwen3-4b --qps "$2" \
    --duration "$DURATION" --label "$1" --commit "$COMMIT" --clients 4 --out "$LOGS/sweep_$1.json" "${@:3}" \
    > "$LOGS/sweep_$1.log" 2>&1
  echo "sweep $1 rc=$?"; grep -E "^qps" "$LOGS/sweep_$1.log"
}

ttft_16k() {  # ttft_16k LABEL: one 16k-token prompt alone, median of 5
  timeout 120 python3 bench/long_prompts.py --url $URL --model qwen3-4b --lengths 16384 --repeats 5 --no-background \
    --max-tokens 4 --out "$LOGS/ttft_16k_$1.json" > "$LOGS/ttft_16k_$1.log" 2>&1
  echo "16k $1 rc=$?"; tail -4 "$LOGS/ttft_16k_$1.log"
}

roofline() {  # roofline TAG MODEL BATCHES [extra env assignments...]; ROOFLINE_ARGS: more decode_roofline.py flags
  local tag=$1 model=$2 batches=$3; shift 3
  env "$@" timeout "${ROOFLINE_TIMEOUT:-80}" python3 bench/decode_roofline.py --model-dir "bench/models/$model" \
    --batches "$batches" --eager-batches "" --steps 20 --profile --profile-steps 3 --out "$LOGS/$tag.json" \
    ${ROOFLINE_ARGS:-} > "$LOGS/$tag.log" 2>&1
  echo "$tag rc=$?"; grep -A8 "^batch *floor" "$LOGS/$tag.log" | tail -8; pack
}

switch_ab() {  # switch_ab TAG MODEL BATCHES SWITCH: the decode step with the INFER_CUDA_ switch SWITCH at 0 and 1,
  # interleaved twice (TAG_0, TAG_1, TAG_0b, TAG_1b)
  local run
  for run in 0 1 0b 1b; do roofline "$1_$run" "$2" "$3" "$4=${run:0:1}"; done
}

ablate() {  # ablate MODEL BATCHES SECONDS: bench/ablate_step.py (the decode step with one part made free at a time)
  timeout "$3" python3 bench/ablate_step.py --model-dir "bench/models/$1" --batches "$2" --out "$LOGS/ablate_$1.json" \
    > "$LOGS/ablate_$1.log" 2>&1
  echo "ablate rc=$?"; tail -12 "$LOGS/ablate_$1.log"; pack
}

gpu_tests() {  # gpu_tests TAG SECONDS FILES... [-k EXPR]; MARK (default gpu): the marker expression, e.g. "gpu or not
  # gpu" to run the interpreter-sized tests on the GPU as well (their `device` fixture is cuda there)
  local tag=$1 secs=$2; shift 2
  timeout -s INT "$secs" python3 -m pytest -m "${MARK:-gpu}" -q -p no:cacheprovider -rfE "$@" \
    > "$LOGS/pytest_$tag.log" 2>&1
  echo "pytest $tag rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest_$tag.log" | tail -8; pack
}

session_logs() {  # session_logs TAG: a session script's $LOGS ($OUT/TAG), URL, DURATION, PYTHONUNBUFFERED, COMMIT, SCRIPTS, the
  # commit line, and `pack` (the logs and any engines' into $OUT/TAG.tar.gz, after every part: a cut run returns them)
  OUT=${OUT:-/tmp/out}; LOGS=$OUT/$1; mkdir -p "$LOGS"; SESSION_TAG=$1
  URL=${URL:-http://127.0.0.1:8000}; DURATION=${DURATION:-15}
  export PYTHONUNBUFFERED=1
  COMMIT=${COMMIT:-unknown}
  SCRIPTS=packages/infer-backend-cuda/scripts
  echo "commit $COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$LOGS/commit.txt"
  pack() { tar -czf "$OUT/$SESSION_TAG.tar.gz" -C "$OUT" "$SESSION_TAG" $( [ -d "$OUT/engines" ] && echo engines ); }
}

installed_table() {  # installed_table KERNEL: the path of the installed tuned table of kernels/KERNEL.py (`_TABLE`)
  python3 -c "from infer_backend_cuda.kernels import $1 as K; print(K._TABLE)"
}

tune_in_model() {  # tune_in_model SCHEME MODEL BUDGET_S [ROWS]: bench/tune_in_model.py's winners at ROWS (default 1;
  # scored by the decode step's replay) into the installed tables, which come back in $LOGS, then the replay on them
  local rows=${4:-1}
  timeout "$3" python3 bench/tune_in_model.py --scheme "$1" --rows "$rows" --model-dir "bench/models/$2" \
    --rounds "${ROUNDS:-1}" --write-table --out "$LOGS/tune_$1_m$rows.json" > "$LOGS/tune_$1_m$rows.log" 2>&1
  echo "tune $1 rows=$rows rc=$?"; grep -E "re-scored|keeps|merged|left as" "$LOGS/tune_$1_m$rows.log"
  local kernel; for kernel in awq_gemm fp8_gemm mid_gemm skinny_gemm; do cp "$(installed_table $kernel)" "$LOGS/"; done
  roofline "$1_m${rows}_tuned" "$2" "$rows"
}

TREE_CONFIGS=packages/infer-backend-cuda/src/infer_backend_cuda/configs

configs_ab() {  # configs_ab TAG MODEL BATCHES A B LABEL_A LABEL_B: the decode step on the tuned tables of folder A
  # against folder B's (each a full set of configs/*.json), interleaved twice on this machine; A's are left installed
  local site run; site=$(dirname "$(installed_table awq_gemm)")
  for run in "$6" "$7" "${6}2" "${7}2"; do
    case $run in
      "$6"*) cp "$4"/*.json "$site/" ;;
      *) cp "$5"/*.json "$site/" ;;
    esac
    roofline "$1_$run" "$2" "$3"
  done
  cp "$4"/*.json "$site/"
}

tables_ab() {  # tables_ab TAG MODEL BATCHES: the installed tables (a tune's) against the tree's, interleaved twice on
  # this machine; the installed ones are kept (and come back in $LOGS/tuned_configs)
  local site; site=$(dirname "$(installed_table awq_gemm)")
  mkdir -p "$LOGS/tuned_configs"; cp -n "$site"/*.json "$LOGS/tuned_configs/"
  configs_ab "$1" "$2" "$3" "$LOGS/tuned_configs" "$TREE_CONFIGS" tuned base
}

tune_table() {  # tune_table FMT ROWS BUDGET_S TAG: bench_quant_gemm.py's bests at these rows into the installed table
  # (`awq_gemm` / `fp8_gemm` `_TABLE`), the log's summary printed, the table copied into the logs
  local fmt=$1 rows=$2 budget=$3 tag=$4 table
  table=$(installed_table "${fmt}_gemm")
  timeout $(( budget + 60 )) python3 "$SCRIPTS/bench_quant_gemm.py" --formats "$fmt" --ms "$rows" --budget-s "$budget" \
    --json "$LOGS/$tag.json" --table "$table" > "$LOGS/$tag.log" 2>&1
  echo "bench_quant_gemm $fmt rc=$?"; grep -A40 "^ fmt" "$LOGS/$tag.log"; cp "$table" "$LOGS/${fmt}_gemm_table.json"; pack
}

tune_mid_unless_tuned() {  # tune_mid_unless_tuned TAG BUDGET_S: tune_mid on a GPU the installed table has no entries for
  python3 -c "import sys, torch; from infer_backend_cuda.kernels import mid_gemm as G
sys.exit(0 if G._tuned_table(torch.cuda.get_device_name()) else 1)" || tune_mid "$1" "$2"
}
tune_mid() {  # tune_mid TAG BUDGET_S: bench_mid_gemm.py's bests (ops OPS, rows MS; the script's defaults when unset) into
  # the installed table (this GPU's entries), the log's summary printed, the table copied into the logs as mid_gemm.json
  local table; table=$(installed_table mid_gemm)
  timeout $(( $2 + 90 )) python3 "$SCRIPTS/bench_mid_gemm.py" ${OPS:+--ops "$OPS"} ${MS:+--ms "$MS"} --budget-s "$2" \
    --json "$LOGS/$1_tune.json" --table "$table" > "$LOGS/$1_tune.log" 2>&1
  echo "bench_mid_gemm rc=$?"; grep -A60 "^ *op  *m" "$LOGS/$1_tune.log"; cp "$table" "$LOGS/mid_gemm.json"; pack
}

h200_then() {  # h200_then SCRIPT NEXT: a session script's CALL=auto / h200: `h200_served` first on an H200 (or when
  # CALL=h200), then CALL=NEXT of SCRIPT
  if [ "${CALL:-auto}" = h200 ] || [ "$(gpu_branch)" = h200 ]; then h200_served; fi
  CALL=$2 bash "$1"
}

gpu_branch() {  # gpu_branch: the session scripts' CALL=auto choice: h200 on an H200, else $OTHER (default next)
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo h200; else echo "${OTHER:-next}"; fi
}

h200_served() {  # h200_served: the mid GEMM tuned where the table lacks this GPU (copy the returned mid_gemm.json into
  # packages/infer-backend-cuda/src/infer_backend_cuda/configs/), then on the served config with that table chat at
  # qps 1 and 32 and the ~3,000-token prompts at qps 4 with the 512-token cap (LONG_S s)
  tune_mid_unless_tuned h200 "${BUDGET:-150}"
  if engine_up base RUSTINFER_MAX_MODEL_LEN=32768; then
    sweep base_chat 1,32; engine_down base; pack
  fi
  if engine_up cap512 RUSTINFER_MAX_MODEL_LEN=32768 RUSTINFER_PREFILL_TOKENS_WHILE_DECODING=512; then
    DURATION=${LONG_S:-30} sweep cap512_long 4 --workload long; engine_down cap512; pack
  fi
}
