# Shared by the device-session scripts (moe_session.sh, moe_offload_session.sh): source it from the project's root.
#   env: OUT (logs), MODEL (default /tmp/qwen3moe-30b.gguf, made if missing with make_model.py MAKE_ARGS, default
#        the qwen3moe-30b preset), ROUNDS (2), REPS (2), THREADS (16),
#        TESTS (1: the script's GPU test files, or TEST_FILES; all: every GPU test; 0: none), LBENCH (llama-bench)
mkdir -p "$OUT"
export COLUMNS=200 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [[ ! -d /tmp/site/gguf ]]; then  # the device image has no gguf package
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
MODEL=${MODEL:-/tmp/qwen3moe-30b.gguf}
MAKE_ARGS=${MAKE_ARGS:---arch qwen3moe --preset qwen3moe-30b}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-2}
THREADS=${THREADS:-16}
LBENCH=${LBENCH:-/root/lbuild/bin/llama-bench}  # where .llamacpp/build.sh builds it (its log's last line)
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }

# llama.cpp's build and the model in the background, then the GPU tests (default files: the arguments) meanwhile
session_setup() {
  LB_PID=
  if [[ -d .llamacpp && ! -x $LBENCH ]]; then
    (bash .llamacpp/build.sh build > "$OUT/lbuild.log" 2>&1) &
    LB_PID=$!
  fi
  MK_PID=
  if [[ ! -f $MODEL ]]; then
    python3 scripts/make_model.py "$MODEL" $MAKE_ARGS > "$OUT/make_model.log" 2>&1 &
    MK_PID=$!
  fi
  if [[ ${TESTS:-1} != 0 ]]; then
    local what limit xdist=
    python3 -c 'import xdist' 2>/dev/null && xdist="-n 6"
    if [[ ${TESTS:-1} == all ]]; then what=(-m gpu tests); limit=330; else
      what=(${TEST_FILES:-$@}); limit=240; fi
    stamp "GPU tests: ${what[*]}"
    NUMBA_NUM_THREADS=4 timeout -k 5 $limit python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $xdist \
      "${what[@]}" > "$OUT/tests.log" 2>&1
    stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -30; tail -n 1 "$OUT/tests.log"
  fi
  [[ -n $MK_PID ]] && wait "$MK_PID"
  stamp "model: $(ls -la "$MODEL" | awk '{print $5}') bytes"
}

# wait for llama.cpp's build (if session_setup started one); LBENCH is then its binary, or empty if it failed
wait_llama() {
  [[ -n ${LB_PID:-} ]] && wait "$LB_PID"
  [[ -f $OUT/lbuild.log ]] && LBENCH=$(tail -n 1 "$OUT/lbuild.log")
  [[ -x $LBENCH ]] || { echo "no llama-bench:"; tail -n 5 "$OUT/lbuild.log" 2>/dev/null; LBENCH=; }
  stamp "llama-bench: ${LBENCH:-none}"
}

# bench_pair NAME ROUND N_GEN FLAGS...: hybrid bench, then llama-bench with the same flags (-p 512 -n N_GEN -r REPS),
# into OUT/{hybrid,llama}_NAME_ROUND.json (scripts/bench_summary.py tables them)
bench_pair() {
  local name=$1 round=$2 n_gen=$3
  shift 3
  stamp "round $round $name: hybrid bench $*"
  timeout -k 5 240 python3 -m hybrid bench -m "$MODEL" -o json -p 512 -n "$n_gen" -r "$REPS" "$@" \
    > "$OUT/hybrid_${name}_$round.json" 2> "$OUT/hybrid_${name}_$round.err"
  stamp "rc=$?"; tail -n 3 "$OUT/hybrid_${name}_$round.err"
  if [[ -n $LBENCH && -x $LBENCH ]]; then
    stamp "round $round $name: llama-bench $*"
    timeout -k 5 240 "$LBENCH" -m "$MODEL" -o json -p 512 -n "$n_gen" -r "$REPS" "$@" \
      > "$OUT/llama_${name}_$round.json" 2> "$OUT/llama_${name}_$round.err"
    stamp "rc=$?"
  fi
}

# bench_ncmoe N,N,...: ROUNDS rounds of bench_pair at -ngl 99 -ncmoe N (pp512, tg128) for each N, then the table
bench_ncmoe() {
  local round n
  stamp "n-cpu-moe values: $1"
  for round in $(seq 1 "$ROUNDS"); do
    for n in ${1//,/ }; do
      bench_pair "n$n" "$round" 128 -ngl 99 -ncmoe "$n" -fa 1 -t "$THREADS"
    done
  done
  stamp "summary"
  python3 scripts/bench_summary.py "$OUT" --label "-ngl 99 --n-cpu-moe N" | tee "$OUT/summary.md"
}

# tests_beside_models PYTEST_ARGS...: the Llama-3-8B-shaped model (L8B) and MODEL made in the background (where missing)
# while pytest runs PYTEST_ARGS (TEST_LIMIT seconds, default 420) into OUT/tests.log; then waits for every background
# job (a llama.cpp build the caller started too) and says the models' sizes
tests_beside_models() {
  [[ -f $L8B ]] || python3 scripts/make_model.py "$L8B" --arch llama --preset llama-8b > "$OUT/make_l8b.log" 2>&1 &
  [[ -f $MODEL ]] || python3 scripts/make_model.py "$MODEL" $MAKE_ARGS > "$OUT/make_moe.log" 2>&1 &
  stamp "GPU tests: $*"
  NUMBA_NUM_THREADS=8 timeout -k 5 "${TEST_LIMIT:-420}" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    "$@" > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -n 1 "$OUT/tests.log"
  wait
  stamp "models: $(ls -la "$L8B" "$MODEL" 2>&1 | awk '{print $5, $NF}' | tr '\n' ' ')"
}

wait_up() {  # wait_up URL PID: until /health answers 200 (300 s at most)
  local i
  for i in $(seq 1 600); do
    kill -0 "$2" 2>/dev/null || return 1
    curl -sf "$1/health" > /dev/null && return 0
    sleep 0.5
  done
  return 1
}

serve_up() {  # serve_up PORT LOG ARGS...: start a server (ARGS, its PID in SPID) and wait_up; 1 when it did not come up
  local port=$1 log=$2
  shift 2
  "$@" > "$log" 2>&1 &
  SPID=$!
  wait_up "http://127.0.0.1:$port" $SPID || { echo "the server did not come up:"; tail -n 5 "$log"; return 1; }
}
serve_down() {  # serve_down SIGNAL: stop SPID, at most 20 s (a server under cProfile once never exited on SIGINT)
  kill -"$1" $SPID 2>/dev/null
  for _ in $(seq 40); do kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
  kill -0 $SPID 2>/dev/null && { echo "the server did not stop on SIG$1: killed"; kill -9 $SPID; }
  wait $SPID 2>/dev/null
}
