#!/usr/bin/env bash
# MoE on the GPU machine, in one device call: `hybrid bench` against llama.cpp's `llama-bench` (built here from
# .llamacpp, see ../shared/device/llamacpp.sh prepare) on a synthetic Qwen3-30B-A3B-shaped Q4_K_M model, alternating
# ROUNDS times per placement, plus the GPU tests, a decode and an MoE prefill profile of the model; a table last.
#
#   bash scripts/moe_session.sh [PLACEMENTS]    PLACEMENTS: comma list of gpu,cpu (default: gpu,cpu)
#   env: OUT (logs, default /tmp/moe_session), MODEL (default /tmp/qwen3moe-30b.gguf, made if missing),
#        ROUNDS (default 2), REPS (llama-bench/hybrid bench -r, default 2), THREADS (default 16),
#        TESTS (1: the MoE GPU tests, default; all: every GPU test; 0: none)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe_session}
mkdir -p "$OUT"
export COLUMNS=200 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the device image has no gguf package
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
PLACEMENTS=${1:-gpu,cpu}
MODEL=${MODEL:-/tmp/qwen3moe-30b.gguf}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-2}
THREADS=${THREADS:-16}
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }

LB_PID=
if [[ -d .llamacpp ]]; then
  (bash .llamacpp/build.sh build > "$OUT/lbuild.log" 2>&1) &
  LB_PID=$!
fi
MK_PID=
if [[ ! -f $MODEL ]]; then
  python3 scripts/make_model.py "$MODEL" --arch qwen3moe --preset qwen3moe-30b > "$OUT/make_model.log" 2>&1 &
  MK_PID=$!
fi
if [[ ${TESTS:-1} != 0 ]]; then  # 1: the MoE tests; all: every GPU test (pytest -m gpu), while llama.cpp builds
  XDIST=; python3 -c 'import xdist' 2>/dev/null && XDIST="-n 6"
  if [[ ${TESTS:-1} == all ]]; then what=(-m gpu tests); limit=330; else
    what=(tests/test_gpu_moe.py tests/test_moe_groups.py); limit=240; fi
  stamp "GPU tests: ${what[*]}"
  NUMBA_NUM_THREADS=4 timeout -k 5 $limit python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $XDIST \
    "${what[@]}" > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -n 1 "$OUT/tests.log"
fi
[[ -n $MK_PID ]] && wait "$MK_PID"
stamp "model: $(tail -n 1 "$OUT/make_model.log" 2>/dev/null) $(ls -la "$MODEL" | awk '{print $5}') bytes"
stamp "decode profile"
timeout -k 5 150 python3 scripts/decode_profile.py "$MODEL" --depth 64 --json "$OUT/profile.json" > "$OUT/profile.out" 2>&1
stamp "profile rc=$?"; grep -iE "moe|tg_tps|graph_tps|graph_gpu|bandwidth_limit_tps|graph_report" "$OUT/profile.out" | head -20
timeout -k 5 120 python3 scripts/moe_prefill_profile.py "$MODEL" -n 512 --real --layer 20 > "$OUT/prefill_profile.out" 2>&1
stamp "prefill profile rc=$?"; cat "$OUT/prefill_profile.out" | tail -n 12
LBENCH=
if [[ -n $LB_PID ]]; then
  wait "$LB_PID"
  LBENCH=$(tail -n 1 "$OUT/lbuild.log")
  [[ -x $LBENCH ]] || { echo "llama.cpp build failed:"; tail -n 5 "$OUT/lbuild.log"; LBENCH=; }
fi
stamp "llama-bench: ${LBENCH:-none}"
for round in $(seq 1 "$ROUNDS"); do
  for pl in ${PLACEMENTS//,/ }; do
    if [[ $pl == gpu ]]; then flags=(-ngl 99 -fa 1); else flags=(-ngl 0 -fa 1 -t "$THREADS"); fi
    stamp "round $round $pl: hybrid bench ${flags[*]}"
    timeout -k 5 240 python3 -m hybrid bench -m "$MODEL" -o json -p 512 -n 64 -r "$REPS" "${flags[@]}" \
      > "$OUT/hybrid_${pl}_$round.json" 2> "$OUT/hybrid_${pl}_$round.err"
    stamp "rc=$?"; tail -n 2 "$OUT/hybrid_${pl}_$round.err"
    if [[ -n $LBENCH ]]; then
      stamp "round $round $pl: llama-bench ${flags[*]}"
      timeout -k 5 240 "$LBENCH" -m "$MODEL" -o json -p 512 -n 64 -r "$REPS" "${flags[@]}" \
        > "$OUT/llama_${pl}_$round.json" 2> "$OUT/llama_${pl}_$round.err"
      stamp "rc=$?"
    fi
  done
done
stamp "summary"
python3 scripts/bench_summary.py "$OUT" --label "placement" | tee "$OUT/summary.md"

stamp "done"
