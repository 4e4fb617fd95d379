#!/usr/bin/env bash
# The all-GPU 8B model's batched decode on the GPU machine, one device call:
#   GPU tests of TEST_FILES (xdist, TEST_LIMIT s) beside the model's making; scripts/gpu_q8t_check.py (the products of
#   2-8 rows, every design); hybrid bench --batched -npl 1,4,8; scripts/gpu_mixed_step.py (MIXED_ARGS: steps that
#   carry a prompt chunk, eager and through the decode graphs).
# env: OUT (/tmp/bdec), L8B (/tmp/l8b.gguf), TEST_FILES, TEST_LIMIT (230), STAGES (tests,q8t,batched,mixed)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bdec}
L8B=${L8B:-/tmp/l8b.gguf}
MODEL=$L8B
MAKE_ARGS="--arch llama --preset llama-8b"
source scripts/session_lib.sh
STAGES=${STAGES:-tests,q8t,batched,mixed}
has() { [[ ,$STAGES, == *,$1,* ]]; }

[[ -f $L8B ]] || python3 scripts/make_model.py "$L8B" $MAKE_ARGS > "$OUT/make_l8b.log" 2>&1 &
if has tests; then
  files=${TEST_FILES:-tests/test_kernels_gpu.py tests/test_gpu_fused.py tests/test_gpt_oss.py tests/test_gpu_moe.py \
tests/test_gpu_paged.py tests/test_engine_batch.py}
  xdist=; python3 -c 'import xdist' 2>/dev/null && xdist="-n 6"
  stamp "GPU tests: $files"
  NUMBA_NUM_THREADS=4 timeout -k 5 "${TEST_LIMIT:-230}" python3 -m pytest -q -rfEs --tb=line -p no:cacheprovider \
    $xdist $files > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |^/" "$OUT/tests.log" | head -40; tail -n 2 "$OUT/tests.log"
fi
wait
stamp "model: $(ls -la "$L8B" | awk '{print $5}') bytes"
if has q8t; then
  stamp "scripts/gpu_q8t_check.py"
  timeout -k 5 150 python3 scripts/gpu_q8t_check.py --tokens 2,4,8 > "$OUT/q8t.txt" 2>&1
  grep -E "tokens: default|one token|B=" "$OUT/q8t.txt"
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
stamp done
