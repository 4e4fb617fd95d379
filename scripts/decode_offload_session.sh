#!/usr/bin/env bash
# A split model's decode batches streamed to the GPU (op offload's DecodeChoice) and the all-GPU MoE's budget check,
# on the GPU machine, one device call a phase:
#   bash scripts/decode_offload_session.sh tests  the GPU tests of TEST_FILES (default: the engine's decode and offload
#                                                 files) while the models are made and llama-bench builds
#   bash scripts/decode_offload_session.sh split  the 8B at -ngl 16: hybrid serve -np 8 loaded at concurrency 1 and 8
#                                                 (scripts/bench_serve.py), then hybrid bench --batched -npl 1,2,4,8
#   bash scripts/decode_offload_session.sh pool   the 30B MoE all on the GPU: scripts/gpu_pool_check.py with the 24 GiB
#                                                 budget and without, at -c 4096 and at the tests' own context, then
#                                                 hybrid bench and llama-bench (pp512, tg128) with and without the
#                                                 budget, ROUNDS rounds
# env: OUT (/tmp/decode_offload), L8B (/tmp/l8b.gguf), MOE (/tmp/qwen3moe-30b-skew.gguf), THREADS (16), ROUNDS (2),
#      POOL_RUNS (the pool phase's checks, '-c:budget' words: '4096:24GiB 4096: 0:24GiB 0:')
set -u
cd "$(dirname "$0")/.."
PHASE=${1:-tests}
OUT=${OUT:-/tmp/decode_offload}
L8B=${L8B:-/tmp/l8b.gguf}
MODEL=${MOE:-/tmp/qwen3moe-30b-skew.gguf}
MAKE_ARGS="--arch qwen3moe --preset qwen3moe-30b --router-skew 1.0"
TESTS=0
source scripts/session_lib.sh

case $PHASE in
tests)
  if [[ -d .llamacpp && ! -x $LBENCH ]]; then (bash .llamacpp/build.sh build > "$OUT/lbuild.log" 2>&1) & fi
  tests_beside_models -m gpu ${TEST_FILES:-tests/test_offload.py tests/test_engine_batch.py tests/test_gpu_paged.py \
    tests/test_split.py}
  stamp "llama-bench: $(tail -n 1 "$OUT/lbuild.log" 2>/dev/null)" ;;
split)
  stamp "hybrid serve $L8B -ngl 16 -np 8 -c 16384 -t $THREADS"
  python3 -m hybrid serve "$L8B" -ngl 16 -np 8 -c 16384 -t "$THREADS" --port 8091 > "$OUT/serve16.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 400); do curl -sf http://127.0.0.1:8091/health > /dev/null && break; sleep 0.5; done
  timeout -k 5 300 python3 scripts/bench_serve.py --url http://127.0.0.1:8091 --label "hybrid -ngl 16" -c 1,8,8 \
    --requests 8 --prompt-tokens 256 --max-tokens 128 --prefix-tokens 0 --json "$OUT/serve16.json" 2>&1 | tail -n 6
  curl -s http://127.0.0.1:8091/metrics | grep -E "offload|decode" | head -6
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  grep -iE "offload|error" "$OUT/serve16.log" | head -5
  stamp "hybrid bench --batched -ngl 16"
  timeout -k 5 200 python3 -m hybrid bench -m "$L8B" -ngl 16 -t "$THREADS" --batched -npp 128 -ntg 64 \
    -npl 1,2,4,8,8 2>&1 | tail -n 9
  stamp "done" ;;
pool)
  for run in ${POOL_RUNS:-4096:24GiB 4096: 0:24GiB 0:}; do  # -c:budget ('' none; -c 0: the tests' own context)
    c=${run%%:*} budget=${run#*:}
    stamp "gpu_pool_check -c $c --vram-budget '$budget'"
    timeout -k 5 150 python3 scripts/gpu_pool_check.py -m "$MODEL" -c "$c" -n 128 --vram-budget "$budget" \
      -t "$THREADS" 2>&1 | tail -n 3
  done
  [[ -x $LBENCH ]] || LBENCH=$(tail -n 1 "$OUT/lbuild.log" 2>/dev/null)
  for round in $(seq 1 "$ROUNDS"); do
    for budget in 24GiB ""; do
      stamp "round $round: hybrid bench -ngl 99 --vram-budget '$budget'"
      timeout -k 5 200 python3 -m hybrid bench -m "$MODEL" -o json -p 512 -n 128 -r 3 -ngl 99 -fa 1 \
        -t "$THREADS" ${budget:+--vram-budget $budget} 2> /dev/null |
        python3 -c "import json,sys; print(*(f\"{r['test']}: {r['avg_ts']:.1f}\" for r in json.load(sys.stdin)))"
    done
    if [[ -x $LBENCH ]]; then
      stamp "round $round: llama-bench -ngl 99"
      timeout -k 5 200 "$LBENCH" -m "$MODEL" -o json -p 512 -n 128 -r 3 -ngl 99 -fa 1 -t "$THREADS" 2> /dev/null |
        python3 -c "import json,sys; print(*(f\"pp{r['n_prompt']}/tg{r['n_gen']}: {r['avg_ts']:.1f}\" for r in json.load(sys.stdin)))"
    fi
  done
  stamp "done" ;;
esac
