#!/usr/bin/env bash
# One device call for the closing notes of issues 5 and 6: the GPU tests and `hybrid bench` (all on the GPU, and
# -ngl 16 / 0 with op offload, and -ngl 16 without), the prefill-attention check, the GPU prefill, GPU decode and
# CPU decode profiles, `hybrid probe` as a user sees it (8B under 4 GiB; the 3090-like 32B case under 12 GiB with
# the measured thread sweep), and `hybrid run -ngl auto`. Logs under $OUT; ~8 minutes.
#   bash scripts/gpu_session.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 COLUMNS=160
T0=$(date +%s); stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
step() {  # NAME SECONDS CMD...: stdout+stderr -> $OUT/NAME.txt, its tail shown
  local name=$1 t=$2; shift 2
  stamp "$name"
  timeout -k 5 "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  stamp "$name rc=$rc"; tail -n "${TAIL:-25}" "$OUT/$name.txt"
}
[ -f /tmp/q32b.gguf ] || (python3 scripts/make_model.py /tmp/q32b.gguf --arch qwen2 --preset qwen-32b > /dev/null 2>&1 &)
OUT=$OUT/bench DEADLINE=210 NGL_SPLIT="16 0" REPS_SPLIT=3 bash scripts/gpu_bench.sh tests,gpu,split > "$OUT/bench.txt" 2>&1
grep -E "^\| |FAILED|ERROR|passed|failed" "$OUT/bench.txt" | grep -v "| F16 |\|| Q4_K_M |" | tail -25
TAIL=30 step attention_check 100 python3 scripts/gpu_attention_check.py
TAIL=4 step bench_ngl16_no_offload 90 python3 -m hybrid bench -m /tmp/l8b.gguf -p 512 -n 0 -ngl 16 -t 16 -r 2 -nopo 1
TAIL=22 step prefill_profile 80 python3 scripts/gpu_prefill_profile.py /tmp/l8b.gguf
TAIL=20 step cpu_decode_profile 90 python3 scripts/cpu_decode_profile.py /tmp/l8b.gguf -t 16 -n 16
TAIL=30 step decode_profile 100 python3 scripts/decode_profile.py /tmp/l8b.gguf --depth 64 --json "$OUT/profile.json"
TAIL=40 step probe_8b 60 python3 -m hybrid probe /tmp/l8b.gguf -c 4096 --vram-budget 4GiB --fast
TAIL=40 step probe_32b 120 python3 -m hybrid probe /tmp/q32b.gguf -c 4096 --vram-budget 12GiB
TAIL=6 step ngl_auto 60 python3 -m hybrid run /tmp/l8b.gguf -ngl auto --vram-budget 4GiB -c 4096 -p "hello world" -n 8 -t 16
stamp done
