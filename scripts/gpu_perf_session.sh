#!/usr/bin/env bash
# One device call for issue 5's speed work: the GPU tests, the fused-kernel check (correctness + old vs new
# timings), `hybrid bench` all on the GPU (f16 and q8_0 KV) and split (-ngl 16 / 0, 16 threads), and the decode,
# prefill and CPU-decode profiles, and scripts/probe_check.sh; logs under $OUT, the bench table last. ~6 minutes.
#   bash scripts/gpu_perf_session.sh [PHASES]   PHASES: comma list of tests,check,bench,split,profile,probe (default all)
set -u
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/gpu_perf_out}  # the device tool brings back 8 files at most: logs go to a work folder, then
OUT=/tmp/gpu_perf_work             # a tarball of them all goes to $FINAL
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 COLUMNS=160
PHASES=${1:-tests,check,bench,split,profile,probe}
MODEL=${MODEL:-/tmp/l8b.gguf}
has() { [[ ",$PHASES," == *",$1,"* ]]; }
T0=$(date +%s); stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
step() {  # NAME SECONDS TAIL CMD...: stdout+stderr -> $OUT/NAME.txt, its tail shown
  local name=$1 t=$2 n=$3; shift 3
  stamp "$name"
  timeout -k 5 "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  stamp "$name rc=$rc"; tail -n "$n" "$OUT/$name.txt"
}
[ -f "$MODEL" ] || (python3 scripts/make_model.py "$MODEL" --arch llama --preset llama-8b > "$OUT/make_model.txt" 2>&1 &)
if has tests; then
  XDIST=; python3 -c 'import xdist' 2>/dev/null && XDIST="-n 6"
  NUMBA_NUM_THREADS=4 step tests 240 6 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider $XDIST \
    tests/test_kernels_gpu.py tests/test_gpu_*.py tests/test_split.py tests/test_offload.py
  grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -20
fi
has check && step fused_check 150 40 python3 scripts/gpu_fused_check.py
while [ ! -f "$MODEL" ] || pgrep -f "make_model.py $MODEL" > /dev/null; do sleep 1; done
B="python3 -m hybrid bench -m $MODEL"
if has bench; then
  step bench_gpu 100 8 $B -p 512 -n 128 -ngl 99 -fa 1 -r 5
  step bench_gpu_q8 100 8 $B -p 512 -n 128 -ngl 99 -fa 1 -r 5 -ctk q8_0 -ctv q8_0
fi
if has split; then
  step bench_ngl16 120 8 $B -p 512 -n 64 -ngl 16 -t 16 -r 3
  step bench_ngl0 150 8 $B -p 512 -n 64 -ngl 0 -t 16 -r 3
  step bench_ngl24_8 150 10 $B -p 512 -n 64 -ngl 24,8 -t 16 -r 3
fi
if has profile; then
  step decode_profile 100 30 python3 scripts/decode_profile.py "$MODEL" --depth 64 --json "$OUT/profile.json"
  step prefill_profile 80 24 python3 scripts/gpu_prefill_profile.py "$MODEL"
  step cpu_decode_profile 90 22 python3 scripts/cpu_decode_profile.py "$MODEL" -t 16 -n 16
fi
has probe && step probe_check 200 40 bash scripts/probe_check.sh
stamp done
tar -czf "$FINAL/logs.tar.gz" -C "$OUT" .
grep -h "^|" "$OUT"/bench_*.txt 2>/dev/null
