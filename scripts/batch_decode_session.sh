#!/usr/bin/env bash
# The all-GPU 8B model's batched decode on the GPU machine, one device call:
#   GPU tests of TEST_FILES (xdist, TEST_LIMIT s) beside the model's making; scripts/gpu_q8t_check.py (the products of
#   2-8 rows, every design); hybrid bench --batched -npl 1,4,8; scripts/gpu_mixed_step.py (MIXED_ARGS: steps that
#   carry a prompt chunk, eager and through the decode graphs); with STAGES naming it, scripts/gpu_mmq_check.py (the
#   tensor-core products of MMQ_TOKENS rows, every split); serve (hybrid serve -np 8 loaded by bench_serve.py at
#   CONC); profile (the same under cProfile at concurrency 8); chunked (bench_chunked.py at each -b of BUDGETS);
#   step (scripts/gpu_batch_step.py: a decode step of B sequences); prefill (scripts/gpu_prefill_batch.py: a wave's
#   prompts in one step, PREFILL_ARGS); ops (scripts/gpu_step_ops.py: its GPU time op by
#   op at B = 1 and 8); knock (the same script's --knockout: each kind of op's share of the graph at B = 1 and 8);
#   steps (scripts/serve_steps.py: the server's steps by kind at concurrency 1, then 8); kernels (each kernel of a
#   decode step of each B in KB (default 8) under Nsight Compute: scripts/gpu_step_kernels.py).
# env: OUT (/tmp/bdec), L8B (/tmp/l8b.gguf), TEST_FILES, TEST_LIMIT (230), STAGES (default tests,q8t,batched,mixed;
#      more: mmq,serve,profile,chunked,step,ops,knock,steps,kernels), CONC (1,8,8), BUDGETS (64,8192),
#      STEP_ARGS (more arguments of gpu_batch_step.py), KB (8: the kernels stage's batch sizes),
#      SERVE_VARIANTS (extra flags of each server the serve stage starts, '|' between them: '|-ub 2048' two servers)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bdec}
L8B=${L8B:-/tmp/l8b.gguf}
MODEL=$L8B
MAKE_ARGS="--arch llama --preset llama-8b"
source scripts/session_lib.sh
exec > >(tee -a "$OUT/session.log") 2>&1  # a copy in OUT: it comes back even when the call runs past its limit
STAGES=${STAGES:-tests,q8t,batched,mixed}
has() { [[ ,$STAGES, == *,$1,* ]]; }

MK_PID=
[[ -f $L8B ]] || { python3 scripts/make_model.py "$L8B" $MAKE_ARGS > "$OUT/make_l8b.log" 2>&1 & MK_PID=$!; }
if has tests; then
  files=${TEST_FILES:-tests/test_kernels_gpu.py tests/test_gpu_fused.py tests/test_gpt_oss.py tests/test_gpu_moe.py \
tests/test_gpu_paged.py tests/test_engine_batch.py}
  xdist=; python3 -c 'import xdist' 2>/dev/null && xdist="-n 6"
  stamp "GPU tests: $files"
  # -v: each result on its own line as it comes, so a run cut short by the limit still names its failures
  NUMBA_NUM_THREADS=4 timeout -k 5 "${TEST_LIMIT:-230}" python3 -m pytest -v -rfEs --tb=line -p no:cacheprovider \
    $xdist $files > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?: $(grep -c PASSED "$OUT/tests.log") passed"
  grep -E "(FAILED|ERROR) tests|^E |^/.*Error" "$OUT/tests.log" | head -40; tail -n 2 "$OUT/tests.log"
fi
# the model's job only: a bare `wait` (bash >= 5.1) would also wait for the tee above, which never ends
[[ -n $MK_PID ]] && wait "$MK_PID"
stamp "model: $(ls -la "$L8B" | awk '{print $5}') bytes"
if has q8t; then
  stamp "scripts/gpu_q8t_check.py"
  timeout -k 5 150 python3 scripts/gpu_q8t_check.py --tokens 2,4,8 > "$OUT/q8t.txt" 2>&1
  grep -E "tokens: default|one token|B=" "$OUT/q8t.txt"
fi
if has mmq; then
  stamp "scripts/gpu_mmq_check.py"
  timeout -k 5 200 python3 scripts/gpu_mmq_check.py --tokens ${MMQ_TOKENS:-16,32,64} > "$OUT/mmq.txt" 2>&1
  grep -vE "^$|^Q|capture" "$OUT/mmq.txt" | tail -n 60
fi
if has batched; then
  stamp "hybrid bench --batched"
  timeout -k 5 120 python3 -m hybrid bench -m "$L8B" -ngl 99 --batched -npp 128 -ntg 128 -npl 1,4,8 2>&1 | tail -n 8
fi
if has mixed; then
  stamp "scripts/gpu_mixed_step.py"
  timeout -k 5 150 python3 scripts/gpu_mixed_step.py "$L8B" ${MIXED_ARGS:---chunks 28,60 --depths 512,7900 --steps 6} \
    > "$OUT/mixed.txt" 2>&1
  head -n 30 "$OUT/mixed.txt"
fi
if has serve; then  # output tokens/s at concurrency 1 and 8, all on the GPU (the issue's goal: 8 >= 5x 1)
  IFS='|' read -r -a variants <<< "${SERVE_VARIANTS:-}"  # extra flags of each server in turn ('|' between them)
  [[ ${#variants[@]} -eq 0 ]] && variants=("")
  for extra in "${variants[@]}"; do
    stamp "hybrid serve -ngl 99 -np 8 -c 16384 $extra; bench_serve -c ${CONC:-1,8,8}"
    if serve_up 8091 "$OUT/serve.log" python3 -m hybrid serve "$L8B" -ngl 99 -np 8 -c 16384 -t 16 $extra \
        --port 8091; then
      timeout -k 5 200 python3 scripts/bench_serve.py --url http://127.0.0.1:8091 -c "${CONC:-1,8,8}" --requests 16 \
        --prompt-tokens 256 --max-tokens 128 --prefix-tokens 0 --json "$OUT/serve.json" 2>&1 | tail -n 7
    fi
    serve_down TERM
  done
fi
if has steps; then  # the worker's steps at concurrency 1, then 8 (scripts/serve_steps.py): what the waves' prefill holds
  IFS='|' read -r -a variants <<< "${SERVE_VARIANTS:-}"
  [[ ${#variants[@]} -eq 0 ]] && variants=("")
  for i in "${!variants[@]}"; do
    extra=${variants[$i]}
    stamp "serve_steps.py: hybrid serve -ngl 99 -np 8 -c 16384 $extra; bench_serve -c 1, then -c 8,8"
    if serve_up 8093 "$OUT/serve_steps.log" python3 scripts/serve_steps.py --log "$OUT/steps$i.jsonl" -- "$L8B" \
        -ngl 99 -np 8 -c 16384 -t 16 $extra --port 8093; then
      timeout -k 5 100 python3 scripts/bench_serve.py --url http://127.0.0.1:8093 -c 1 --requests 16 \
        --prompt-tokens 256 --max-tokens 128 --prefix-tokens 0 2>&1 | tail -n 2
      python3 scripts/serve_steps.py --summary "$OUT/steps$i.jsonl" | head -n 12
      t8=$(date +%s.%N)
      timeout -k 5 100 python3 scripts/bench_serve.py --url http://127.0.0.1:8093 -c 8,8 --requests 16 \
        --prompt-tokens 256 --max-tokens 128 --prefix-tokens 0 2>&1 | tail -n 4
      python3 scripts/serve_steps.py --summary "$OUT/steps$i.jsonl" --after "$t8" | head -n 30
    fi
    serve_down TERM
  done
fi
if has kernels; then  # each kernel of a decode step at each B of KB (8) under Nsight Compute
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  KB=${KB:-8}
  for kb in ${KB//,/ }; do
    stamp "ncu: scripts/gpu_step_kernels.py -b $kb"
    timeout -k 5 240 "$NCU" --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum --csv \
      --log-file "$OUT/kernels$kb.csv" python3 scripts/gpu_step_kernels.py "$L8B" -b "$kb" --depth 256 \
      > "$OUT/ncu$kb.log" 2>&1
    stamp "ncu rc=$?"; tail -n 3 "$OUT/ncu$kb.log"
    python3 scripts/gpu_step_kernels.py --parse "$OUT/kernels$kb.csv" | head -n 40
  done
fi
if has prefill; then  # a wave of prompts in one eval_batch: ms, tokens/s, host launching against waiting
  stamp "scripts/gpu_prefill_batch.py"
  timeout -k 5 200 python3 scripts/gpu_prefill_batch.py "$L8B" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.txt" \
    | head -n 50
fi
if has profile; then  # the worker (the CLI's main thread) under cProfile at concurrency 8
  stamp "hybrid serve under cProfile; bench_serve -c 8"
  if serve_up 8094 "$OUT/serve_prof.log" python3 -m cProfile -o "$OUT/worker.prof" -m hybrid serve "$L8B" -ngl 99 \
      -np 8 -c 16384 -t 16 --port 8094; then
    timeout -k 5 120 python3 scripts/bench_serve.py --url http://127.0.0.1:8094 -c 8 --requests 16 \
      --prompt-tokens 256 --max-tokens 128 --prefix-tokens 0 2>&1 | tail -n 3
  fi
  serve_down INT
  [[ -f $OUT/worker.prof ]] && python3 -c "import pstats; s = pstats.Stats('$OUT/worker.prof'); s.sort_stats('tottime').print_stats(25); \
s.sort_stats('cumulative').print_stats(30)" 2>&1 | grep -vE "^$|Ordered|function calls" | cut -c1-160 | head -n 70
fi
if has chunked; then  # 4 streams and an 8,000-token prompt at each -b of BUDGETS (a large one: unchunked)
  OUT=$OUT L8B=$L8B THREADS=$THREADS BUDGETS=${BUDGETS:-64,8192} bash scripts/mixed_step_session.sh chunked
fi
if has ops; then
  stamp "scripts/gpu_step_ops.py"
  timeout -k 5 150 python3 scripts/gpu_step_ops.py "$L8B" -b 1,8 2>&1 | tee "$OUT/step_ops.txt" | head -n 60
fi
if has knock; then
  stamp "scripts/gpu_step_ops.py --knockout"
  timeout -k 5 200 python3 scripts/gpu_step_ops.py "$L8B" -b 1,8 --knockout 2>&1 | tee "$OUT/knockout.txt" | tail -n 40
fi
if has step; then
  stamp "scripts/gpu_batch_step.py"
  timeout -k 5 150 python3 scripts/gpu_batch_step.py "$L8B" ${STEP_ARGS:-} 2>&1 | head -n 30
fi
stamp done
