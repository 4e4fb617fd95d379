#!/usr/bin/env bash
# One call on the GPU machine for speculative decoding: every GPU test (TESTS=all, the default; 0: none) while a
# Llama-3-8B-shaped Q4_K_M model is written, then `hybrid bench --spec-type none,ngram` all on the GPU, ROUNDS times,
# on free-form text (nothing to copy) and on the default code prompt; a table of the ratios last.
#   bash scripts/spec_session.sh          env: OUT, MODEL (default /tmp/l8b.gguf), ROUNDS (2), REPS (3), N_GEN (128)
set -u
OUT=${OUT:-/tmp/spec_out}
MODEL=${MODEL:-/tmp/l8b.gguf}
N_GEN=${N_GEN:-128}
TESTS=${TESTS:-all}
REPS=${REPS:-3}
source scripts/session_lib.sh

MK_PID=
if [[ ! -f $MODEL ]]; then
  python3 scripts/make_model.py "$MODEL" --arch llama --preset llama-8b > "$OUT/make_model.log" 2>&1 &
  MK_PID=$!
fi
if [[ $TESTS != 0 ]]; then
  stamp "GPU tests"
  NUMBA_NUM_THREADS=4 timeout -k 5 330 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --continue-on-collection-errors -m gpu tests \
    > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -n 1 "$OUT/tests.log"
fi
[[ -n $MK_PID ]] && wait "$MK_PID"
stamp "model: $(tail -n 1 "$OUT/make_model.log" 2>/dev/null)"

cat > /tmp/free.txt <<'EOF'
The history of the lighthouse keepers on the northern coast is a story of isolation, weather and small rituals.
Each keeper kept a log of ships, storms and supplies, and wrote letters that arrived weeks after they were sent.
EOF
for round in $(seq 1 "$ROUNDS"); do
  for prompt in free code; do
    args=(); [[ $prompt == free ]] && args=(-f /tmp/free.txt)
    stamp "round $round $prompt"
    timeout -k 5 240 python3 -m hybrid bench -m "$MODEL" -ngl 99 -p 0 -n "$N_GEN" -r "$REPS" \
      --spec-type none,ngram "${args[@]}" -o json > "$OUT/spec_${prompt}_$round.json" 2> "$OUT/spec_${prompt}_$round.err"
    stamp "rc=$?"; tail -n 2 "$OUT/spec_${prompt}_$round.err"
  done
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
print("| prompt | round | plain t/s | ngram t/s | ngram / plain | acceptance | drafts / steps |")
print("|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(f"{sys.argv[1]}/spec_*_*.json")):
    try:
        rows = json.load(open(f))
    except ValueError:
        continue
    plain = next(r for r in rows if r["spec_type"] == "none")
    ng = next(r for r in rows if r["spec_type"] == "ngram")
    name = f.rsplit("/", 1)[1][5:-5]
    print(f"| {name.rsplit('_', 1)[0]} | {name.rsplit('_', 1)[1]} | {plain['avg_ts']:.1f} | {ng['avg_ts']:.1f} | "
          f"{ng['avg_ts'] / plain['avg_ts']:.3f} | {ng['acceptance_rate']:.2f} | {ng['n_drafts']} / {ng['n_steps']} |")
EOF
stamp "done"
