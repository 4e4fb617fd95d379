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
PLACEMENTS=${1:-gpu,cpu}
source scripts/session_lib.sh
session_setup tests/test_gpu_moe.py tests/test_moe_groups.py
stamp "decode profile"
timeout -k 5 150 python3 scripts/decode_profile.py "$MODEL" --depth 64 --json "$OUT/profile.json" > "$OUT/profile.out" 2>&1
stamp "profile rc=$?"; grep -iE "moe|tg_tps|graph_tps|graph_gpu|bandwidth_limit_tps|graph_report" "$OUT/profile.out" | head -20
timeout -k 5 120 python3 scripts/moe_prefill_profile.py "$MODEL" -n 512 --real --layer 20 > "$OUT/prefill_profile.out" 2>&1
stamp "prefill profile rc=$?"; cat "$OUT/prefill_profile.out" | tail -n 12
wait_llama
for round in $(seq 1 "$ROUNDS"); do
  for pl in ${PLACEMENTS//,/ }; do
    if [[ $pl == gpu ]]; then flags=(-ngl 99 -fa 1); else flags=(-ngl 0 -fa 1 -t "$THREADS"); fi
    bench_pair "$pl" "$round" 64 "${flags[@]}"
  done
done
stamp "summary"
python3 scripts/bench_summary.py "$OUT" --label "placement" | tee "$OUT/summary.md"

stamp "done"
