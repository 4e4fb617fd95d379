#!/usr/bin/env bash
# One call on the GPU machine for `hybrid probe` (issue 6): for the 8B and 32B synthetic Q4_K_M models under
# budgets that force a partial fit, probe (predicted vs measured ceiling, recommendation), then run the
# recommended -ngl (512-token prompt + generated tokens), the measured ceiling (512-token prompt + 8 tokens: it
# must run, the plan must not refuse it) and ceiling+1 (must be a clean one-line error).
#   bash scripts/probe_check.sh     (logs and a summary under $OUT)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/probe_check_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 COLUMNS=200
T0=$(date +%s); stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
[ -f /tmp/l8b.gguf ] || python3 scripts/make_model.py /tmp/l8b.gguf --arch llama --preset llama-8b > /dev/null
[ -f /tmp/q32b.gguf ] || python3 scripts/make_model.py /tmp/q32b.gguf --arch qwen2 --preset qwen-32b > /dev/null
case_run() {  # MODEL CTX BUDGET KV NGEN
  local m=$1 c=$2 b=$3 kv=$4 n=$5 tag; tag=$(basename "$m" .gguf)-c$2-$3-$4
  python3 - "$m" <<'PY' > /tmp/prompt512.txt  # a prompt of 512 tokens (with BOS) in this model's vocabulary
import sys
from gguf_io import open_gguf
from hybrid.tokenizer import Tokenizer
with open_gguf(sys.argv[1]) as f:
    tok = Tokenizer.from_metadata(f.metadata)
words = []
while len(tok.encode(" ".join(words), True, True)) < 512:
    words.append(f"w{len(words) % 97}")
sys.stdout.write(" ".join(words[:-1]))
PY
  stamp "probe $tag"
  /usr/bin/time -f "%e s" python3 -m hybrid probe "$m" -c "$c" --vram-budget "$b" -ctk "$kv" -ctv "$kv" --fast --json \
      > "$OUT/$tag.json" 2> "$OUT/$tag.err"; tail -1 "$OUT/$tag.err"
  local pred meas rec
  read -r pred meas rec < <(python3 -c "import json;d=json.load(open('$OUT/$tag.json'));print(d['predicted_ngl'],d['measured_ceiling'],d['recommended_ngl'])")
  echo "$tag predicted $pred measured $meas recommended $rec$([ "$pred" = "$meas" ] && echo ' (prediction exact)')" | tee -a "$OUT/summary.txt"
  python3 -c "import json;d=json.load(open('$OUT/$tag.json'));print('  attempts:',', '.join('%d %s pool peak %.1f MiB %.1f s'%(a['ngl'],'fits' if a['fits'] else 'OOM',a['peak_bytes']/2**20,a['seconds']) for a in d['attempts']))" | tee -a "$OUT/summary.txt"
  stamp "run recommended -ngl $rec"
  python3 -m hybrid run "$m" -ngl "$rec" -c "$c" --vram-budget "$b" -ctk "$kv" -ctv "$kv" -t 16 -f /tmp/prompt512.txt \
      -n "$n" --temp 0 --json > "$OUT/$tag.run.json" 2> "$OUT/$tag.run.err"
  echo "  run -ngl $rec: rc=$? $(python3 -c "import json;d=json.load(open('$OUT/$tag.run.json'));t=d['timings'];print(len(d['prompt_ids']),'prompt',len(d['generated_ids']),'generated','pp %.1f tg %.1f t/s'%(t['prompt_per_second'],t['predicted_per_second']))" 2>&1)" | tee -a "$OUT/summary.txt"
  stamp "run measured ceiling -ngl $meas"  # the plan must not refuse the measured ceiling (issue 6)
  python3 -m hybrid run "$m" -ngl "$meas" -c "$c" --vram-budget "$b" -ctk "$kv" -ctv "$kv" -t 16 -f /tmp/prompt512.txt \
      -n 8 --temp 0 --json > "$OUT/$tag.ceiling.json" 2> "$OUT/$tag.ceiling.err"
  echo "  run -ngl $meas (ceiling): rc=$? $(python3 -c "import json;d=json.load(open('$OUT/$tag.ceiling.json'));t=d['timings'];print('RAN',len(d['prompt_ids']),'prompt',len(d['generated_ids']),'generated','pp %.1f tg %.1f t/s'%(t['prompt_per_second'],t['predicted_per_second']))" 2>/dev/null || echo "DID NOT RUN: $(tail -1 "$OUT/$tag.ceiling.err")")" | tee -a "$OUT/summary.txt"
  stamp "run ceiling+1 -ngl $((meas + 1))"
  python3 -m hybrid run "$m" -ngl "$((meas + 1))" -c "$c" --vram-budget "$b" -ctk "$kv" -ctv "$kv" -p hi -n 1 > /dev/null 2> "$OUT/$tag.over.err"
  echo "  run -ngl $((meas + 1)): rc=$? $(tail -1 "$OUT/$tag.over.err")" | tee -a "$OUT/summary.txt"
}
case_run /tmp/l8b.gguf 4096 3GiB f16 128
case_run /tmp/l8b.gguf 4096 4GiB f16 128
case_run /tmp/l8b.gguf 4096 4GiB q8_0 128
case_run /tmp/l8b.gguf 32768 6GiB f16 128
case_run /tmp/l8b.gguf 32768 6GiB q8_0 128
case_run /tmp/q32b.gguf 4096 12GiB f16 16
stamp "probe twice in one process"
python3 - <<'PY' 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
from hybrid.engine import EngineParams
from hybrid.probe_device import try_fit
p = EngineParams(4096, 512, 512, "f16", "f16")
a = [try_fit("/tmp/l8b.gguf", p, n, 4 << 30).fits for n in (20, 23, 24)]
b = [try_fit("/tmp/l8b.gguf", p, n, 4 << 30).fits for n in (20, 23, 24)]
import cupy; print("twice:", a, b, "same" if a == b else "DIFFERENT", "pool after:", cupy.get_default_memory_pool().used_bytes())
PY
stamp done; cat "$OUT/summary.txt"
