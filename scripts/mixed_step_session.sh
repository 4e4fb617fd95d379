#!/usr/bin/env bash
# Mixed steps (prompt chunks beside decoding sequences) on the GPU machine, one device call a phase:
#   bash scripts/mixed_step_session.sh tests    GPU tests of TEST_FILES (default: the tensor-core kernel's, the paged
#                                               engine's, the ragged batch's) beside the 8B model's making, then
#                                               scripts/gpu_mixed_step.py on it (eager / graph, GEMM / tensor cores)
#   bash scripts/mixed_step_session.sh chunked  hybrid serve -np 5 -c 65536 at each -b of BUDGETS, loaded by
#                                               scripts/bench_chunked.py --long-tokens 8000 (4 streams and a long prompt)
# env: OUT (/tmp/mixed), L8B (/tmp/l8b.gguf), THREADS (16), BUDGETS (64,128)
set -u
cd "$(dirname "$0")/.."
PHASE=${1:-tests}
OUT=${OUT:-/tmp/mixed}
L8B=${L8B:-/tmp/l8b.gguf}
MODEL=$L8B
MAKE_ARGS="--arch llama --preset llama-8b"
TESTS=0
source scripts/session_lib.sh

if [[ $PHASE == tests ]]; then
  tests_beside_models ${TEST_FILES:-tests/test_kernels_gpu.py -k "mmq or several_tokens or gemm" tests/test_gpu_paged.py tests/test_engine_batch.py}
  stamp "mixed steps: scripts/gpu_mixed_step.py"
  timeout -k 5 240 python3 scripts/gpu_mixed_step.py "$L8B" ${MIXED_ARGS:-} 2>&1 | tee "$OUT/mixed_step.txt" | head -n 120
  exit 0
fi

[[ -f $L8B ]] || python3 scripts/make_model.py "$L8B" $MAKE_ARGS > "$OUT/make_l8b.log" 2>&1
for b in $(echo "${BUDGETS:-64,128}" | tr ',' ' '); do
  stamp "hybrid serve -ngl 99 -np 5 -c 65536 -b $b"
  if serve_up 8093 "$OUT/serve_$b.log" python3 -m hybrid serve "$L8B" -ngl 99 -np 5 -c 65536 -t "$THREADS" -b "$b" \
      --port 8093; then
    timeout -k 5 240 python3 scripts/bench_chunked.py --url http://127.0.0.1:8093 --long-tokens 8000 --label "-b $b" \
      --json "$OUT/chunked_$b.json" 2>&1 | tail -n 6
  fi
  serve_down TERM
done
stamp "done"
