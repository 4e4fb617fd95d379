#!/usr/bin/env bash
# One device call for the CPU repack (issue 4): the GPU tests (the split and offload ones load CPU layers next to GPU
# layers), then `hybrid bench` of the CPU layers' decode with and without the repacked layout (-nr 0,1), all on the
# CPU and with 16 of 33 layers on the GPU, op offload off (it streams the file's layout, so it keeps the repack off).
#   OUT=$OUT bash scripts/gpu_repack_session.sh            (~8 minutes; logs under $OUT, the bench tables last)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_repack_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 COLUMNS=160
MODEL=${MODEL:-/tmp/l8b.gguf}
T0=$(date +%s); stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
[ -f "$MODEL" ] || (python3 scripts/make_model.py "$MODEL" --arch llama --preset llama-8b > "$OUT/make_model.txt" 2>&1 &)
stamp tests
XDIST=; python3 -c 'import xdist' 2>/dev/null && XDIST="-n 6"
NUMBA_NUM_THREADS=4 timeout -k 5 300 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider $XDIST \
  tests/test_kernels_gpu.py tests/test_gpu_*.py tests/test_split.py tests/test_offload.py tests/test_repack.py \
  > "$OUT/tests.txt" 2>&1
stamp "tests rc=$?"; tail -n 4 "$OUT/tests.txt"; grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -20
while [ ! -f "$MODEL" ] || pgrep -f "make_model.py $MODEL" > /dev/null; do sleep 1; done
B="python3 -m hybrid bench -m $MODEL -p 64 -n 64 -t 16 -r 3 -nopo 1 -nr 0,1"
stamp bench_ngl16; timeout -k 5 200 $B -ngl 16 > "$OUT/bench_ngl16.txt" 2>&1; stamp "rc=$?"
stamp bench_ngl0; timeout -k 5 200 $B -ngl 0 > "$OUT/bench_ngl0.txt" 2>&1; stamp "rc=$?"
grep -h "repack:" "$OUT"/bench_*.txt | sort | uniq -c
grep -h "^|" "$OUT"/bench_*.txt
