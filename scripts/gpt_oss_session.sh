#!/usr/bin/env bash
# gpt-oss-120b-shaped experts in RAM beside attention on the GPU (-ngl 99 --n-cpu-moe N), on the GPU machine, against
# llama.cpp's llama-bench with the same flags (built here from .llamacpp, see ../shared/device/llamacpp.sh prepare).
#
# The model is gpt-oss-120b's layer shape (MXFP4 experts, 128 of which 4 are used, width 2880) at half its depth,
# 18 of 36 layers (the whole 59 GiB file does not fit the machine's 64 GiB disk beside the rest); a 12 GiB budget
# then leaves the same share of its experts on the GPU as 24 GiB leaves of the whole model's.
#
#   bash scripts/gpt_oss_session.sh setup    GPU tests (TEST_FILES), the model and llama.cpp's build in the background,
#                                            then hybrid probe at BUDGET (-c CTX) into OUT/probe.json
#   bash scripts/gpt_oss_session.sh bench    hybrid bench / llama-bench alternated at the probe's N (or NCMOE) and
#                                            --cpu-moe (N = all layers), pp512 and tg128; a table last
#   env: OUT (default /tmp/gpt_oss), MODEL (default /tmp/gpt-oss-120b-h18.gguf), N_LAYER (18), BUDGET (12GiB),
#        CTX (8192), ROUNDS (2), REPS (2), THREADS (16), TESTS (1: TEST_FILES; all; 0: none), NCMOE (a comma list)
set -u
cd "$(dirname "$0")/.."
PHASE=${1:-setup}
OUT=${OUT:-/tmp/gpt_oss}
N_LAYER=${N_LAYER:-18}
MODEL=${MODEL:-/tmp/gpt-oss-120b-h$N_LAYER.gguf}
MAKE_ARGS="--arch gpt-oss --preset gpt-oss-120b --type MXFP4_MOE --n-layer $N_LAYER"
BUDGET=${BUDGET:-12GiB}
CTX=${CTX:-8192}
source scripts/session_lib.sh

if [[ $PHASE == setup ]]; then
  session_setup ${TEST_FILES:-tests/test_gpu_moe_gated.py tests/test_gpu_moe.py tests/test_gpu_host_experts.py}
  wait_llama
  stamp "probe --vram-budget $BUDGET -c $CTX"
  timeout -k 5 240 python3 -m hybrid probe "$MODEL" -c "$CTX" --vram-budget "$BUDGET" --fast --json \
    > "$OUT/probe.json" 2> "$OUT/probe.err"
  stamp "rc=$?"; tail -n 8 "$OUT/probe.err"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('moe') or {}; print('predicted', m.get('predicted'), 'measured', m.get('measured'), 'recommended', m.get('recommended'), '|', r['command'])" "$OUT/probe.json"
  stamp "done"
  exit 0
fi

if [[ -z ${NCMOE:-} ]]; then
  NCMOE=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['moe']['recommended'])" "$OUT/probe.json" \
          2>/dev/null || echo 12),$N_LAYER
fi
bench_ncmoe "$NCMOE"
stamp "done"
