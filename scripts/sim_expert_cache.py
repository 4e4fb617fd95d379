#!/usr/bin/env python3
"""Replay a routing trace (`hybrid trace-experts … -o trace.npz`) through the expert-cache policies: LRU, LFU,
LFRU, a static top list and Belady's offline optimum, at several slot counts per layer; the first half of the
tokens teaches, the second is scored. Prints hit rates (overall and per layer) and uploads per token as markdown
tables, or one JSON object.

    python3 scripts/sim_expert_cache.py trace.npz [--slots 5,8,16] [--inserts N] [--policies lru,lfru] [--json]

The policies live in hybrid/backends/moe_cache/ (policy.py, belady.py, simulate.py); see docs/MOE_CACHE.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.backends.moe_cache.simulate import ALL_POLICIES, default_slots, simulate  # noqa: E402
from hybrid.backends.moe_cache.trace import ExpertTrace  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a trace written by hybrid trace-experts")
    ap.add_argument("--slots", type=_ints, help="slots per layer, comma-separated (default: top_k + 1 .. n_expert)")
    ap.add_argument("--inserts", type=int, help="cap on the online policies' inserts a layer a step (default none)")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES), help=f"some of {','.join(ALL_POLICIES)}")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_args(argv)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None) -> int:
    a = _args(argv)
    trace = ExpertTrace.load(a.trace)
    k, n_expert = trace.top_k, trace.n_expert
    slots = a.slots or default_slots(k, n_expert)
    low = [s for s in slots if not k + 1 <= s <= n_expert]
    if low:
        print(f"slots {low} skipped: a layer takes top_k + 1 = {k + 1} to n_expert = {n_expert}", file=sys.stderr)
        slots = [s for s in slots if s not in low]
    policies = [p for p in a.policies.split(",") if p]
    t0 = time.perf_counter()
    results = simulate(trace, slots, policies, a.inserts)
    dt = time.perf_counter() - t0
    half = trace.n_tok // 2
    if a.json:
        print(json.dumps({"trace": str(a.trace), "model": trace.model, "n_tok": trace.n_tok, "learn_tokens": half,
                          "scored_tokens": trace.n_tok - half, "layers": trace.layers.tolist(), "top_k": k,
                          "n_expert": n_expert, "inserts_cap": a.inserts, "results": [r.to_json() for r in results]}))
        return 0
    cap = "no cap" if a.inserts is None else f"at most {a.inserts} insert(s) a layer a step"
    print(f"{trace.model}: {trace.n_tok} tokens ({half} learn, {trace.n_tok - half} scored), {len(trace.layers)} MoE "
          f"layers, top {k} of {n_expert} experts; online policies: {cap} ({dt:.1f} s)\n")
    by = {(r.policy, r.n_slots): r for r in results}
    print("hit rate (all layers), and uploads per token (experts inserted, all layers):\n")
    print(_table(["slots/layer", *policies, *(f"{p} up/tok" for p in policies if p != "static")],
                 [[str(s), *(f"{by[p, s].hit_rate:.3f}" for p in policies),
                   *(f"{by[p, s].uploads_per_token:.2f}" for p in policies if p != "static")] for s in slots]))
    for s in slots:
        print(f"\nhit rate per layer, {s} slots a layer:\n")
        print(_table(["layer", *policies], [[str(il), *(f"{by[p, s].layer_hits[i]:.3f}" for p in policies)]
                                            for i, il in enumerate(trace.layers.tolist())]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
