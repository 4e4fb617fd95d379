#!/usr/bin/env bash
# The device session: one call on the GPU machine runs every GPU test (pytest -m gpu), a decode profile and
# `hybrid bench` on a synthetic Llama-3-8B-shaped Q4_K_M model (all on the GPU, q8_0 KV, and splits) and
# `hybrid probe`; logs under $OUT, a table against llama.cpp's reference figures for that machine last.
#
#   bash scripts/gpu_session.sh [PHASES]     PHASES: comma list of tests,profile,gpu,split,probe (default: all)
#   env: OUT (logs), MODEL (default /tmp/l8b.gguf, made if missing), DEADLINE (seconds, default 460),
#        REPS_SPLIT (default 3), NGL_SPLIT (default "16 24 8 0")
set -u
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/gpu_session_out}  # the device tool brings back 8 files at most: logs go to a work folder,
OUT=/tmp/gpu_session_work           # then the summary, the test log, the profile and a tarball of it all go here
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
export COLUMNS=250
if ls .whl/*.whl >/dev/null 2>&1; then  # the device image has no gguf package
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
PHASES=${1:-tests,profile,gpu,split,probe}
MODEL=${MODEL:-/tmp/l8b.gguf}
DEADLINE=${DEADLINE:-460}
REPS_SPLIT=${REPS_SPLIT:-3}
NGL_SPLIT=${NGL_SPLIT:-16 24 8 0}
T0=$(date +%s)
has() { [[ ",$PHASES," == *",$1,"* ]]; }
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
# run NAME SECONDS CMD...: under a timeout that also respects the deadline; stdout -> $OUT/NAME.out
run() {
  local name=$1 want=$2; shift 2
  local t; t=$(left); ((t > want)) && t=$want
  if ((t < 15)); then stamp "SKIP $name (no time left)"; echo "skipped: no time" > "$OUT/$name.err"; return 1; fi
  stamp "$name (limit ${t}s): $*"
  timeout -k 5 "$t" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  stamp "$name rc=$rc"; tail -n 4 "$OUT/$name.err"
  return $rc
}

nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/env.txt"
python3 -c 'import cupy, numba, numpy; print("cupy", cupy.__version__, "numba", numba.__version__, "numpy", numpy.__version__)' 2>&1 | tee -a "$OUT/env.txt"
echo "nsys: $(command -v nsys || echo none)  ncu: $(command -v ncu || echo none)" | tee -a "$OUT/env.txt"

MK_PID=
if [[ ! -f $MODEL ]] && (has profile || has gpu || has split || has probe); then
  stamp "making $MODEL in the background"
  python3 scripts/make_model.py "$MODEL" --arch llama --preset llama-8b > "$OUT/make_model.log" 2>&1 &
  MK_PID=$!
fi

if has tests; then
  stamp "GPU tests"
  XDIST=; python3 -c 'import xdist' 2>/dev/null && XDIST="-n 6"
  HYBRID_SPLIT_REPORT=$OUT/split.jsonl NUMBA_NUM_THREADS=4 timeout -k 5 $(( $(left) < 330 ? $(left) : 330 )) \
    python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider $XDIST tests > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  tail -n 3 "$OUT/tests.log"
fi

if [[ -n $MK_PID ]]; then wait "$MK_PID"; stamp "model: $(tail -n 1 "$OUT/make_model.log")"; fi

B="python3 -m hybrid bench -m $MODEL -o json"
if has profile; then
  run profile 90 python3 scripts/decode_profile.py "$MODEL" --depth 64 --json "$OUT/profile.json"
  cat "$OUT/profile.out"
fi
if has gpu; then
  run bench_gpu 100 $B -p 512 -n 128 -ngl 99 -fa 1 -r 3
  run bench_gpu_q8 100 $B -p 512 -n 128 -ngl 99 -fa 1 -r 3 -ctk q8_0 -ctv q8_0
fi
if has probe; then
  run probe_4k 80 python3 -m hybrid probe "$MODEL" -c 4096 --vram-budget 4GiB
  run probe_32k 80 python3 -m hybrid probe "$MODEL" -c 32768 --vram-budget 6GiB -ctk q8_0 -ctv q8_0
  run probe_32k_json 80 python3 -m hybrid probe "$MODEL" -c 32768 --vram-budget 6GiB -ctk q8_0 -ctv q8_0 --json
  for p in probe_4k probe_32k; do echo "--- $p"; tail -n 25 "$OUT/$p.out"; done
fi

if has split; then
  for n in $NGL_SPLIT; do
    run "bench_ngl$n" 150 $B -p 512 -n 64 -ngl "$n" -t 16 -r "$REPS_SPLIT"
  done
fi
stamp "summary"
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import glob, json, os, sys
out = sys.argv[1]
ref = {("gpu", "pp512", "f16"): 9035, ("gpu", "tg128", "f16"): 271, ("gpu", "tg128", "q8_0"): 249,
       (16, "pp512"): 1349, (16, "tg64"): 26.5, (24, "pp512"): 2287, (24, "tg64"): 46.4,
       (8, "pp512"): 933, (8, "tg64"): 18.5, (0, "pp512"): 742, (0, "tg64"): 14.0}
print("| ngl | KV | test | ours t/s | llama.cpp t/s | ours/llama.cpp | GPU decode | op offload |")
print("|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(out, "bench_*.out"))):
    try:
        rows = json.load(open(f))
    except Exception as exc:
        print(f"| {os.path.basename(f)} | | | failed: {type(exc).__name__} | | | | |")
        continue
    for r in rows:
        ngl, kv, test = r["n_gpu_layers"], r["type_k"], r["test"]
        key = ("gpu", test, kv) if ngl >= 33 else (ngl, test)
        lc = ref.get(key)
        ratio = f"{r['avg_ts'] / lc:.2f}" if lc else ""
        dec = (r.get("gpu_decode") or "")[:90]
        print(f"| {ngl} | {kv} | {test} | {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} | {lc or ''} | {ratio} | {dec} | "
              f"{r.get('op_offload', '')} |")
p = os.path.join(out, "profile.json")
if os.path.exists(p):
    s = json.load(open(p))["summary"]
    print(f"\ndecode profile: wall {s['wall_ms_per_token']:.3f} ms/token ({s['tg_tps']:.0f} t/s), graph GPU "
          f"{s['graph_gpu_ms_per_token']:.3f} ms ({s['graph_tps']:.0f} t/s), sum of ops {s['sum_of_ops_ms']:.3f} ms, "
          f"bandwidth limit {s['bandwidth_limit_ms']:.3f} ms ({s['bandwidth_limit_tps']:.0f} t/s)")
s = os.path.join(out, "split.jsonl")
if os.path.exists(s):
    print("\n| arch | weights | max KL any two | max KL before routing flips | GPU vs CPU decode | GPU decode vs prefill "
          "| pairs w/ flips | graph-eager max abs | near ties | greedy divergence (step, at near tie) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for line in sorted(open(s)):
        r = json.loads(line)
        div = {k: (v, r['greedy_divergence_at_near_tie'][k]) for k, v in r['greedy_divergence'].items() if v is not None}
        print(f"| {r['arch']} | {r['mix']} | {r['kl_max']:.2e} | {r['kl_max_strict']:.2e} | "
              f"{r['kl_gpu_vs_cpu_decode']:.2e} | {r['kl_gpu_decode_vs_gpu_prefill']:.2e} | {r['n_pairs_with_flips']} | "
              f"{r['graph_vs_eager_max_abs']} | {r['near_ties_in_ref_greedy']} | {div} |")
EOF
stamp "done"
tail -n 2 "$OUT/tests.log" 2>/dev/null
for f in summary.md tests.log profile.out split.jsonl; do [[ -f $OUT/$f ]] && cp "$OUT/$f" "$FINAL/"; done
tar czf "$FINAL/all_logs.tgz" -C "$OUT" .
