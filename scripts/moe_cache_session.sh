#!/usr/bin/env bash
# The GPU expert cache (--moe-cache) on the GPU machine: experts in RAM beside attention on the GPU (-ngl 99
# --n-cpu-moe N), tg128 and pp512 with the cache (auto) and without it on the same placement, and llama-bench with the
# same flags (built from .llamacpp as in moe_offload_session.sh), on a synthetic Qwen3-30B-A3B-shaped Q4_K_M model
# with a skewed router (and, with EVEN=1, its unskewed twin). Phases, each one device call:
#
#   bash scripts/moe_cache_session.sh tests    the cache's and the host-expert GPU tests, the models, llama.cpp's build
#   bash scripts/moe_cache_session.sh profile  scripts/offload_decode_profile.py with --moe-cache auto and 0 (the
#                                              cache's host call split into its parts), at NCMOE (default 24), 12 GiB
#   bash scripts/moe_cache_session.sh bench    per budget (12, 24 GiB): hybrid probe's N and cache size, then hybrid
#                                              bench --moe-cache auto,0 and llama-bench at that N, and the same at
#                                              every layer's experts in RAM (where the probe offers that with the
#                                              cache, its cache_alternative, and with CPU_MOE=1 at every budget);
#                                              a table last
#   bash scripts/moe_cache_session.sh trace    the cache's measured hit rate next to the simulator's on one trace:
#                                              trace-experts -b 1 through --moe-cache SLOTS (default 64) at
#                                              --cpu-moe, then scripts/sim_expert_cache.py on that trace
#   env: OUT (default /tmp/moe_cache), MODEL (default /tmp/qwen3moe-30b-skew.gguf, made with --router-skew 1.0),
#        EVEN (1: also the unskewed /tmp/qwen3moe-30b.gguf), ROUNDS (2), REPS (2), THREADS (16), CTX (8192),
#        BUDGETS (default "12 24"), NCMOE (skip the probe: this N for every budget), CPU_MOE (1)
set -u
cd "$(dirname "$0")/.."
PHASE=${1:-tests}
OUT=${OUT:-/tmp/moe_cache}
CTX=${CTX:-8192}
BUDGETS=${BUDGETS:-12 24}
MODEL=${MODEL:-/tmp/qwen3moe-30b-skew.gguf}
MAKE_ARGS=${MAKE_ARGS:---arch qwen3moe --preset qwen3moe-30b --router-skew 1.0}
source scripts/session_lib.sh

if [[ $PHASE == tests ]]; then
  session_setup tests/test_gpu_moe_cache.py tests/test_gpu_host_experts.py tests/test_moe_cache_book.py
  if [[ ${EVEN:-0} == 1 && ! -f /tmp/qwen3moe-30b.gguf ]]; then
    python3 scripts/make_model.py /tmp/qwen3moe-30b.gguf --arch qwen3moe --preset qwen3moe-30b > "$OUT/make_even.log" 2>&1
  fi
  wait_llama
  exit 0
fi

if [[ $PHASE == profile ]]; then  # where a decode token goes, with the cache and without (models made by `tests`)
  for cache in auto 0; do
    stamp "profile -ncmoe ${NCMOE:-24} --moe-cache $cache"
    timeout -k 5 200 python3 scripts/offload_decode_profile.py "$MODEL" -ncmoe "${NCMOE:-24}" -t "$THREADS" \
      --vram-budget 12GiB --moe-cache "$cache" --json "$OUT/profile_$cache.json" 2>&1 | tail -n 40
  done
  exit 0
fi

if [[ $PHASE == trace ]]; then  # measured (the runtime cache) against simulated (the same trace's tokens)
  stamp "trace-experts -b 1 --cpu-moe --moe-cache ${SLOTS:-64}"
  timeout -k 5 300 python3 -m hybrid trace-experts "$MODEL" -f docs/DESIGN.md -c 256 --chunks 2 -b 1 -ngl 99 \
    --cpu-moe --moe-cache "${SLOTS:-64}" --vram-budget 12GiB -t "$THREADS" -o "$OUT/trace.npz" --json \
    > "$OUT/trace.json" 2> "$OUT/trace.err"
  stamp "rc=$?"; python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['moe_cache'])" "$OUT/trace.json"
  python3 scripts/sim_expert_cache.py "$OUT/trace.npz" --slots "16,32,${SLOTS:-64}" --inserts 2 | head -n 12
  exit 0
fi

models=("$MODEL")
[[ ${EVEN:-0} == 1 ]] && models+=(/tmp/qwen3moe-30b.gguf)
wait_llama
for m in "${models[@]}"; do
  tag=$(basename "$m" .gguf)
  for budget in $BUDGETS; do
    ns=${NCMOE:-}
    if [[ -z $ns ]]; then
      stamp "$tag: probe --vram-budget ${budget}GiB -c $CTX"
      timeout -k 5 200 python3 -m hybrid probe "$m" -c "$CTX" --vram-budget ${budget}GiB --fast --json \
        > "$OUT/probe_${tag}_$budget.json" 2> "$OUT/probe_${tag}_$budget.err"
      stamp "rc=$?"
      # the probe's N (0: everything fits), then every layer's N (the cache's placement: where the probe offers it
      # as its cache alternative, and with CPU_MOE=1, the default, at every budget)
      ns=$(python3 -c "import json,sys,os; r=json.load(open(sys.argv[1])); alt=r.get('cache_alternative'); n=r.get('recommended_n_cpu_moe') or 0; nl=r['n_offloadable'] - 1; print(n, nl if (alt or os.environ.get('CPU_MOE', '1') == '1') and nl != n else ''); print(r['command'], '|', r['moe_cache']['note'], '|', alt and alt['command'], file=sys.stderr)" "$OUT/probe_${tag}_$budget.json")
    fi
    for n in $ns; do
    for round in $(seq 1 "$ROUNDS"); do
      name="${tag}_b${budget}_n$n"
      stamp "round $round $name: hybrid bench --moe-cache auto,0"
      timeout -k 5 400 python3 -m hybrid bench -m "$m" -o json -p 512 -n 128 -r "$REPS" -ngl 99 -ncmoe "$n" -fa 1 \
        -t "$THREADS" --vram-budget ${budget}GiB --moe-cache auto,0 \
        > "$OUT/hybrid_${name}_$round.json" 2> "$OUT/hybrid_${name}_$round.err"
      stamp "rc=$?"; grep -E "moe cache|t/s" "$OUT/hybrid_${name}_$round.err" | tail -n 6
      if [[ -n $LBENCH && -x $LBENCH && $round == 1 ]]; then
        stamp "llama-bench -ngl 99 -ncmoe $n"
        timeout -k 5 240 "$LBENCH" -m "$m" -o json -p 512 -n 128 -r "$REPS" -ngl 99 -ncmoe "$n" -fa 1 -t "$THREADS" \
          > "$OUT/llama_${name}_$round.json" 2> "$OUT/llama_${name}_$round.err"
        stamp "rc=$?"
      fi
    done
    done
  done
done
stamp "summary"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
from collections import defaultdict
runs = defaultdict(list)
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_b*_n*_*.json"))):
    try:
        rows = json.load(open(f))
    except Exception:  # noqa: BLE001 - a failed run: its .err says why
        continue
    who = os.path.basename(f).split("_")[0]
    name = os.path.basename(f)[len(who) + 1:].rsplit("_", 1)[0]
    for r in rows:
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        run = "llama-bench" if who == "llama" else f"hybrid, --moe-cache {r.get('moe_cache')}"
        runs[(name, test, run)].append((r["avg_ts"], r.get("moe_cache_hit_rate")))
print("| model, budget, N | test | run | t/s (mean of rounds) | hit rate |")
print("|---|---|---|---:|---:|")
for (name, test, who), v in sorted(runs.items()):
    rates = [h for _, h in v if h is not None]
    print(f"| {name} | {test} | {who} | {sum(t for t, _ in v) / len(v):.2f} | "
          f"{(sum(rates) / len(rates)) if rates else float('nan'):.3f} |")
PY
stamp "done"
