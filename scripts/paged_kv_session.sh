#!/usr/bin/env bash
# The paged KV cache of `run` (Engine.new_cache) on the GPU machine, one device call a phase:
#   bash scripts/paged_kv_session.sh tests   the GPU tests of TEST_FILES (default: every test marked gpu), the models
#   bash scripts/paged_kv_session.sh bench   scripts/bench_paged_kv.py (paged vs contiguous, alternated in one
#                                            process) on a Llama-3-8B-shaped Q4_K_M at -ngl 99 and -ngl 16, and on the
#                                            Qwen3-30B-A3B-shaped Q4_K_M (skewed router) all on the GPU; then hybrid
#                                            bench -p 512 --moe-cache in both orders (auto,0 and 0,auto) at --cpu-moe,
#                                            12 GiB (whether a cold expert cache costs prompts anything); then
#                                            scripts/serve_soak.py on the 8B at -np 8 (SOAK=1, the default)
# env: OUT (/tmp/paged_kv), L8B (/tmp/l8b.gguf), MOE (/tmp/qwen3moe-30b-skew.gguf), THREADS (16), ROUNDS (3),
#      SPLIT (1: also the 8B at -ngl 16), SOAK (1)
set -u
cd "$(dirname "$0")/.."
PHASE=${1:-tests}
OUT=${OUT:-/tmp/paged_kv}
L8B=${L8B:-/tmp/l8b.gguf}
MODEL=${MOE:-/tmp/qwen3moe-30b-skew.gguf}
MAKE_ARGS="--arch qwen3moe --preset qwen3moe-30b --router-skew 1.0"
TESTS=0
source scripts/session_lib.sh

if [[ $PHASE == tests ]]; then
  tests_beside_models ${TEST_FILES:--m gpu tests}
  exit 0
fi

R=${ROUNDS:-3}
stamp "paged vs contiguous: 8B, -ngl 99"
timeout -k 5 150 python3 scripts/bench_paged_kv.py -m "$L8B" -p 512 -n 128 -ngl 99 -t "$THREADS" --rounds "$R" \
  --paired 64,2048 2>&1 |
  tail -n 12
if [[ ${SPLIT:-0} == 1 ]]; then
  stamp "paged vs contiguous: 8B, -ngl 16"
  timeout -k 5 200 python3 scripts/bench_paged_kv.py -m "$L8B" -p 512 -n 32 -ngl 16 -t "$THREADS" --rounds "$R" \
    2>&1 | tail -n 12
fi
stamp "paged vs contiguous: 30B MoE, all on the GPU"
timeout -k 5 150 python3 scripts/bench_paged_kv.py -m "$MODEL" -p 512 -n 128 -ngl 99 -t "$THREADS" --rounds "$R" \
  --paired 64,2048 2>&1 |
  tail -n 12
for order in auto,0 0,auto auto,0 0,auto; do
  stamp "hybrid bench -p 512 --cpu-moe --moe-cache $order, 12 GiB"
  timeout -k 5 150 python3 -m hybrid bench -m "$MODEL" -o json -p 512 -n 0 -r 3 -ngl 99 -cmoe -fa 1 -t "$THREADS" \
    --vram-budget 12GiB --moe-cache "$order" 2> /dev/null |
    python3 -c "import json,sys; print(*(f\"cache {r['moe_cache']}: {r['avg_ts']:.1f}\" for r in json.load(sys.stdin)))"
done
if [[ ${SOAK:-1} == 1 ]]; then  # the serving reliability run on the GPU: 2 rounds of 200 requests, 32 clients
  stamp "serve soak: 8B all on the GPU, -np 8 -c 16384"
  timeout -k 5 240 python3 scripts/serve_soak.py -m "$L8B" --server-args "-np 8 -c 16384 -ngl 99 -t $THREADS" \
    --json "$OUT/soak.json" 2>/dev/null | tail -n 12
fi
stamp "done"
