#!/usr/bin/env bash
# Device calls for continuous batching: `hybrid serve -np NP` (one paged KV cache, decode batches as CUDA graphs)
# against llama.cpp's llama-server with the same flags, on a Llama-3-8B-shaped Q4_K_M model.
#   STAGE=setup bash scripts/serve_session.sh   builds llama-server (background), writes the model, runs TEST_FILES
#   STAGE=bench bash scripts/serve_session.sh   for each NGL: scripts/bench_serve.py at CONC against hybrid serve,
#                                               then llama-server, ROUNDS times; `hybrid bench --batched` last
#   STAGE=all bash scripts/serve_session.sh     one call: the build (background), the model, TEST_FILES,
#                                               scripts/gpu_batch_step.py; once the build is done, hybrid serve at
#                                               each NGL (CONC at the first, 1 and NP after), then llama-server at the
#                                               first NGL
# env: OUT (/tmp/serve_out), MODEL (/tmp/l8b.gguf), NGLS (99,16), NP (8), CTX (16384), CONC (1,4,8,16), REQUESTS (16),
#      PROMPT (256), GEN (128), ROUNDS (1), THREADS (16), LSERVER ($HOME/lbuild/bin/llama-server),
#      EXTRA (more flags for both servers, e.g. '-ub 2048'), BATCHED (1: the bench stage's hybrid bench --batched)
# llama-server's source: `bash ../shared/device/llamacpp.sh prepare`, then put back tools/ui's CMakeLists.txt and
# *.in from the same sdist (prepare drops tools/ui; with -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF the server
# builds without its web page); carry [".llamacpp", ".whl"].
set -u
OUT=${OUT:-/tmp/serve_out}
MODEL=${MODEL:-/tmp/l8b.gguf}
MAKE_ARGS=${MAKE_ARGS:---arch llama --preset llama-8b}
NGLS=${NGLS:-99,16}
NP=${NP:-8}
CTX=${CTX:-16384}
CONC=${CONC:-1,4,8,16}
REQUESTS=${REQUESTS:-16}
PROMPT=${PROMPT:-256}
GEN=${GEN:-128}
LB=${LBUILD:-$HOME/lbuild}
LSERVER=${LSERVER:-$LB/bin/llama-server}
TESTS=0  # session_lib's own test run: this script runs its files itself
source scripts/session_lib.sh

build_server() {
  cmake -S .llamacpp -B "$LB" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$OUT/lcmake.log" 2>&1 &&
    cmake --build "$LB" -j"$(nproc)" --target llama-server > "$OUT/lbuild.log" 2>&1
}

serve_one() {  # serve_one hybrid|llama NGL ROUND: start that server, load it with bench_serve.py, stop it
  local tool=$1 ngl=$2 round=$3 port cmd
  if [[ $tool == hybrid ]]; then
    port=8091; cmd=(python3 -m hybrid serve "$MODEL")
  else
    [[ -x $LSERVER ]] || { echo "no llama-server"; tail -n 20 "$OUT/lbuild.log" "$OUT/lcmake.log" 2>/dev/null; return; }
    port=8092; cmd=("$LSERVER" -m "$MODEL" -fa on)
  fi
  local tag=${EXTRA:+_${EXTRA// /}}
  stamp "$tool -ngl $ngl -np $NP ${EXTRA:-}, round $round"
  if serve_up $port "$OUT/${tool}_serve_${ngl}${tag}_$round.log" "${cmd[@]}" -ngl "$ngl" -np "$NP" -c "$CTX" \
      -t "$THREADS" ${EXTRA:-} --port $port; then
    timeout -k 5 400 python3 scripts/bench_serve.py --url http://127.0.0.1:$port --label "$tool -ngl $ngl ${EXTRA:-}" \
      -c "$CONC" --requests "$REQUESTS" --prompt-tokens "$PROMPT" --max-tokens "$GEN" --prefix-tokens 0 \
      --json "$OUT/${tool}_${ngl}${tag}_$round.json" 2>&1 | tail -n 14
    [[ $tool == hybrid ]] && curl -s http://127.0.0.1:$port/metrics | grep -E "kv_blocks|preempt" | head -4
  fi
  serve_down TERM
}

serve_pair() {  # serve_pair NGL ROUND
  serve_one hybrid "$1" "$2"
  serve_one llama "$1" "$2"
}

case ${STAGE:-setup} in
all)
  if [[ ! -x $LSERVER && -d .llamacpp ]]; then build_server & LB_PID=$!; fi
  [[ -f $MODEL ]] || python3 scripts/make_model.py "$MODEL" $MAKE_ARGS > "$OUT/make_model.log" 2>&1
  stamp "GPU tests: ${TEST_FILES:-tests/test_gpu_paged.py}"
  NUMBA_NUM_THREADS=4 timeout -k 5 ${TEST_LIMIT:-200} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    ${TEST_FILES:-tests/test_gpu_paged.py} > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -40; tail -n 1 "$OUT/tests.log"
  timeout -k 5 150 python3 scripts/gpu_batch_step.py "$MODEL" | tee "$OUT/batch_step.txt"
  first=${NGLS%%,*}
  # the servers only after the build: a cmake -j on every host core beside hybrid serve halved its -ngl 16 figures
  [[ -n ${LB_PID:-} ]] && { stamp "waiting for the llama-server build"; wait "$LB_PID"; }
  serve_one hybrid "$first" 1
  for ngl in $(echo "${NGLS//,/ }" | cut -d' ' -f2-); do CONC=1,$NP REQUESTS=$NP serve_one hybrid "$ngl" 1; done
  serve_one llama "$first" 1 ;;
setup)
  if [[ ! -x $LSERVER && -d .llamacpp ]]; then build_server & LB_PID=$!; fi
  if [[ ! -f $MODEL ]]; then python3 scripts/make_model.py "$MODEL" $MAKE_ARGS > "$OUT/make_model.log" 2>&1 & fi
  stamp "GPU tests: ${TEST_FILES:-tests/test_gpu_paged.py}"
  NUMBA_NUM_THREADS=4 timeout -k 5 ${TEST_LIMIT:-300} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    ${TEST_FILES:-tests/test_gpu_paged.py} > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -40; tail -n 1 "$OUT/tests.log"
  wait
  stamp "model: $(ls -la "$MODEL" 2>/dev/null | awk '{print $5}') bytes; llama-server: $(ls "$LSERVER" 2>/dev/null)"
  [[ -x $LSERVER ]] || tail -n 20 "$OUT/lbuild.log" "$OUT/lcmake.log" 2>/dev/null ;;
bench)
  for round in $(seq 1 "$ROUNDS"); do
    for ngl in ${NGLS//,/ }; do serve_pair "$ngl" "$round"; done
  done
  [[ ${BATCHED:-1} == 1 ]] || exit 0
  stamp "hybrid bench --batched"
  timeout -k 5 200 python3 -m hybrid bench -m "$MODEL" -ngl 99 --batched -npp 128 -ntg 128 -npl 1,4,8 \
    > "$OUT/batched.txt" 2>&1; tail -n 8 "$OUT/batched.txt" ;;
esac
