#!/usr/bin/env bash
# One call on the GPU machine for op offload (issue 5): the GPU tests of tests/test_offload.py, the weight
# stream's own rate (host memmap -> pinned -> device, by copy threads), then pp512 at -ngl 16 and 0 with op
# offload on (-nopo 0) and off (-nopo 1) on the synthetic Llama-3-8B-shaped Q4_K_M model; logs under $OUT.
#   bash scripts/offload_check.sh        env: OUT (default /tmp/offload_check_out), MODEL (default /tmp/l8b.gguf)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/offload_check_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # the device image has no gguf package
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 COLUMNS=200
MODEL=${MODEL:-/tmp/l8b.gguf}
T0=$(date +%s); stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }

MK_PID=
if [[ ! -f $MODEL ]]; then
  stamp "making $MODEL in the background"
  python3 scripts/make_model.py "$MODEL" --arch llama --preset llama-8b > "$OUT/make_model.log" 2>&1 &
  MK_PID=$!
fi

stamp "GPU tests (tests/test_offload.py)"
NUMBA_NUM_THREADS=4 timeout -k 5 200 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
  tests/test_offload.py > "$OUT/tests.log" 2>&1
stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -n 2 "$OUT/tests.log"

if [[ -n $MK_PID ]]; then wait "$MK_PID"; stamp "model: $(tail -n 1 "$OUT/make_model.log")"; fi

stamp "stream rate: the CPU layers' matrices of -ngl 16 through WeightStream, no compute"
timeout -k 5 120 python3 - "$MODEL" <<'EOF' 2>&1 | tee "$OUT/stream_rate.txt"
import sys, time
import cupy
from gguf_io import ModelConfig, open_gguf
from hybrid.offload import row_pieces, slot_bytes, stream_order
from hybrid.weights import load_weights
from kernels_gpu.transfer import WeightStream

f = open_gguf(sys.argv[1])
cfg = ModelConfig.from_gguf(f)
w = load_weights(f, cfg)
srcs = []
for lw in w.layers[:17]:  # -ngl 16 keeps layers 0..16 on the CPU
    for k in stream_order(lw):
        raw = lw[k].raw
        srcs += [raw[a:b].reshape(-1) for a, b in row_pieces(raw.shape[0], raw.shape[1], slot_bytes(f.tensors))]
total = sum(s.nbytes for s in srcs)
for s in srcs:  # fault the pages in once (the bench's warm-up does the same)
    s[::4096].sum()
for threads in (1, 2, 4, 8):
    ws = WeightStream(slot_bytes(f.tensors), copy_threads=threads)
    for rep in range(2):
        t0 = time.perf_counter()
        ws.start(srcs)
        for _ in srcs:
            ws.release(ws.take())
        cupy.cuda.get_current_stream().synchronize()
        ws.stop()
        dt = time.perf_counter() - t0
    print(f"copy_threads={threads}: {total / 2**30:.2f} GiB in {dt * 1000:.0f} ms = {total / dt / 1e9:.1f} GB/s")
    ws.close()
EOF

B="python3 -m hybrid bench -m $MODEL -o json -p 512 -n 0 -t 16 -r 3"
stamp "bench: -ngl 16,0 x -nopo 0,1"
timeout -k 5 420 $B -ngl 16,0 -nopo 0,1 > "$OUT/bench.json" 2> "$OUT/bench.err"
stamp "bench rc=$?"; tail -n 6 "$OUT/bench.err"

python3 - "$OUT/bench.json" <<'EOF' | tee "$OUT/summary.md"
import json, sys
ref = {16: 1349, 0: 742}  # llama.cpp pp512, same machine kind and model shape
try:
    rows = json.load(open(sys.argv[1]))
except Exception as exc:
    sys.exit(f"no bench rows: {type(exc).__name__}: {exc}")
print("| -ngl | op offload | pp512 t/s | samples | llama.cpp | ours / llama.cpp | streamed |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    ngl, on = r["n_gpu_layers"], not r["no_op_offload"]
    lc = ref.get(ngl)
    print(f"| {ngl} | {'on' if on else 'off'} | {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} | "
          f"{', '.join(f'{s:.0f}' for s in r['samples_ts'])} | {lc or ''} | "
          f"{r['avg_ts'] / lc:.2f} | {r.get('op_offload', '')} |" if lc else f"| | {r.get('op_offload', '')} |")
EOF
stamp "done"
