#!/usr/bin/env bash
# Experts in RAM beside attention on the GPU (-ngl 99 --n-cpu-moe N), on the GPU machine, against llama.cpp's
# llama-bench with the same flags (built here from .llamacpp, see ../shared/device/llamacpp.sh prepare), on a
# synthetic Qwen3-30B-A3B-shaped Q4_K_M model. Two phases, so each fits one device call:
#
#   bash scripts/moe_offload_session.sh probe    GPU tests, the model, llama.cpp's build, hybrid probe at 12 and 24 GiB
#   bash scripts/moe_offload_session.sh bench    hybrid bench / llama-bench alternated at the probe's N and 48
#                                                (--cpu-moe); a table last
#   bash scripts/moe_offload_session.sh runs     a 512-token prompt + 128 tokens at --vram-budget 12GiB with the probe's
#                                                recommendation, its measured minimum and one below it (must fail cleanly)
#   bash scripts/moe_offload_session.sh all      GPU tests, the model and llama.cpp's build, then bench and runs (the probe's
#                                                figures from NCMOE / REC, MIN: no probe)
#   env: OUT (logs, default /tmp/moe_offload), MODEL (default /tmp/qwen3moe-30b.gguf, made if missing), ROUNDS (2),
#        REPS (2), THREADS (16), CTX (8192), TESTS (1: the host-expert and MoE GPU tests; all; 0: none), NCMOE (the
#        bench's N list, default: from the probe's JSON in OUT)
set -u
cd "$(dirname "$0")/.."
PHASE=${1:-probe}
OUT=${OUT:-/tmp/moe_offload}
CTX=${CTX:-8192}
source scripts/session_lib.sh

if [[ $PHASE == probe ]]; then
  session_setup tests/test_gpu_host_experts.py tests/test_gpu_moe.py
  wait_llama
  for budget in 12 24; do
    stamp "probe --vram-budget ${budget}GiB -c $CTX"
    timeout -k 5 200 python3 -m hybrid probe "$MODEL" -c "$CTX" --vram-budget ${budget}GiB --fast --json \
      > "$OUT/probe_$budget.json" 2> "$OUT/probe_$budget.err"
    stamp "rc=$?"; tail -n 12 "$OUT/probe_$budget.err"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('moe') or {}; print('predicted', m.get('predicted'), 'measured', m.get('measured'), 'recommended', r.get('recommended_n_cpu_moe'), '|', r['command'])" "$OUT/probe_$budget.json"
  done
  exit 0
fi
if [[ $PHASE == all ]]; then
  session_setup tests/test_gpu_host_experts.py tests/test_gpu_moe.py
  wait_llama
fi

# ---- bench
if [[ $PHASE == bench || $PHASE == all ]]; then
if [[ -z ${NCMOE:-} ]]; then
  NCMOE=$(python3 - "$OUT" <<'PY'
import json, os, sys
vals = []
for b in (24, 12):
    try:
        r = json.load(open(os.path.join(sys.argv[1], f"probe_{b}.json")))
        vals.append(r["moe"]["recommended"])
    except Exception:  # noqa: BLE001
        pass
print(",".join(str(v) for v in dict.fromkeys(vals + [48])))
PY
)
fi
bench_ncmoe "$NCMOE"
fi
if [[ $PHASE == runs || $PHASE == all ]]; then
  python3 -c "print(' '.join(['The quick brown fox jumps over the lazy dog.'] * 52))" > "$OUT/prompt.txt"
  for n in ${REC:-23} ${MIN:-20} $(( ${MIN:-20} - 1 )); do
    stamp "run -ngl 99 --n-cpu-moe $n --vram-budget 12GiB -c $CTX, a ~512-token prompt, 128 tokens"
    timeout -k 5 200 python3 -m hybrid run "$MODEL" -ngl 99 --n-cpu-moe "$n" --vram-budget 12GiB -c "$CTX" \
      -f "$OUT/prompt.txt" -n 128 --temp 0 > "$OUT/run_$n.out" 2> "$OUT/run_$n.err"
    stamp "rc=$?"; grep -E "prompt eval|^eval|error|offloaded|experts" "$OUT/run_$n.err" | head -6
  done
fi
stamp "done"
