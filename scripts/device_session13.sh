#!/usr/bin/env bash
# The next device session's first call (written in the twelfth, device time spent): what the twelfth left unmeasured.
#   CALL=1: AWQ at decode batches under load: its GEMMs tuned at 32 / 64 rows into the installed table (buckets 17-32
#           and 33-64, new), the AWQ replay at 32 / 64 rows with it, AWQ chat at qps 8 / 32; FP8 at one row and 2-8
#           rows (the scale prefetch and PDL, not measured there), FP8 chat at qps 1 / 8.
# Usage on the device: source .whl/setup.sh; source scripts/device_setup.sh; CALL=1 COMMIT=abc1234 bash scripts/device_session13.sh
set -u
source "$(dirname "$0")/device_lib.sh"  # session_logs, tune_table, roofline, gpu_tests
session_logs s13

case ${CALL:-1} in
  1)
    tune_table awq "${MS:-32,64}" "${TUNE_S:-100}" quant_awq_wide
    roofline roofline_awq_wide qwen3-4b-awq 32,64
    roofline roofline_fp8_small qwen3-4b-fp8 1,2,4,8
    ENGINES=${ENGINES:-"awq:chat=8,32 fp8:chat=1,8"} DURATION=${DURATION:-15} OUT=$OUT COMMIT=$COMMIT \
      bash scripts/device_engines.sh
    ;;
esac
pack
