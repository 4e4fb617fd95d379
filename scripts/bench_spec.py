#!/usr/bin/env python3
"""Speculative decoding against plain decoding in one process, interleaved, greedy (hybrid.tools.bench_spec).

    python3 scripts/bench_spec.py [-m MODEL] [-n 96] [--reps 3]
        n-gram drafts (adaptive length, and always --draft-max) on three prompts: repetitive code continued after
        `def get_`, a paragraph to repeat, free-form English with nothing to copy
    python3 scripts/bench_spec.py -m TARGET --draft DRAFT [--ks 1,2,4,8] [-n 96] [--reps 3]
        a draft model drafting exactly k tokens a step (k from --ks) and adaptively, on the paragraph prompt

Prints a markdown table: t/s (median of --reps runs), the ratio to plain decoding run in the same loop, the
acceptance rate and the acceptance per draft position; the CPU's name first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.draft import NgramDrafter  # noqa: E402
from hybrid.generate.draft_model import ModelDrafter, check_vocab  # noqa: E402
from hybrid.generate.speculative import Speculator  # noqa: E402
from hybrid.model.files import resolve_model  # noqa: E402
from hybrid.system.devices import probe_machine  # noqa: E402
from hybrid.tools.bench_spec import CODE_PROMPT, run_spec_bench  # noqa: E402

PARAGRAPH = """Repeat the paragraph exactly.

Paragraph: The old mill stood at the edge of the village for two hundred years. Every spring the river rose and \
turned its wheel faster, and the miller's family worked through the night to grind the grain that farmers brought \
from the hills. When the railway came, the mill fell silent, but the villagers kept its doors painted blue. Children \
still dared each other to touch the great wheel, and on summer evenings the old men sat on its steps and argued \
about the weather, the price of wool and the names of the stars. In the hard winter of the flood, the water reached \
the second floor, and the whole village carried sacks of sand to the riverbank until the morning came.

Repeated: The old mill stood at the edge of the village"""
FREE = "The history of the lighthouse keepers on the northern coast is a story of"


def measure(engine, text: str, n: int, reps: int, variants: dict) -> dict:
    """{name: (median t/s, acceptance, acceptance by position)} for each variant, interleaved run by run."""
    ids = engine.tokenizer.encode(text, add_special=True, parse_special=True)
    samples: dict[str, list] = {k: [] for k in variants}
    last = {}
    for _ in range(reps):
        for name, make in variants.items():
            res = run_spec_bench(engine, ids, n, 1, make)
            samples[name].append(res.avg_ts)
            last[name] = res.spec
    return {k: (statistics.median(v), last[k]) for k, v in samples.items()}


def table(rows: list[tuple[str, str, float, float, object]]) -> None:
    print("| prompt | decoding | t/s | ratio to plain | acceptance | acceptance by position |")
    print("|---|---|---|---|---|---|")
    for prompt, name, ts, ratio, st in rows:
        acc = f"{st.rate:.2f}" if st is not None and st.drafted else "-"
        at = " ".join(f"{a / d:.2f}" for a, d in zip(st.accepted_at, st.drafted_at) if d) if st is not None else ""
        print(f"| {prompt} | {name} | {ts:.2f} | {ratio:.2f} | {acc} | {at or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="the target (default: the demo model)")
    ap.add_argument("--draft", default=None, help="a draft model: measure draft-model speculation")
    ap.add_argument("--ks", default="1,2,4,8", help="draft lengths (fixed) with --draft")
    ap.add_argument("-n", type=int, default=96, help="tokens to generate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=8)
    a = ap.parse_args()
    engine = Engine.load(resolve_model(a.model, None), EngineParams(n_ctx=1024))
    engine.warmup()
    print(f"CPU: {probe_machine().cpu_model}; target {Path(engine.gguf.path).name}, {a.n} tokens, median of {a.reps}\n")
    rows = []
    if a.draft:
        draft = Engine.load(resolve_model(a.draft, None), EngineParams(n_ctx=1024))
        check_vocab(engine.tokenizer, draft.tokenizer)
        draft.warmup()
        nv = engine.config.n_vocab
        variants = {"plain": lambda: None}
        for k in (int(x) for x in a.ks.split(",")):
            variants[f"draft, k = {k}"] = (lambda k=k: Speculator(ModelDrafter(draft, nv, 0.0), k, 1, False))
        variants[f"draft, adaptive <= {a.draft_max}"] = lambda: Speculator(ModelDrafter(draft, nv, 0.75), a.draft_max)
        res = measure(engine, PARAGRAPH, a.n, a.reps, variants)
        base = res["plain"][0]
        rows = [("paragraph", k, ts, ts / base, st if k != "plain" else None) for k, (ts, st) in res.items()]
    else:
        variants = {"plain": lambda: None,
                    "ngram, adaptive": lambda: Speculator(NgramDrafter(3, a.draft_max, 1), a.draft_max),
                    f"ngram, always {a.draft_max}": lambda: Speculator(NgramDrafter(3, a.draft_max, 1), a.draft_max,
                                                                       1, False)}
        for name, text in (("repetitive code", CODE_PROMPT), ("repeat a paragraph", PARAGRAPH), ("free-form", FREE)):
            res = measure(engine, text, a.n, a.reps, variants)
            base = res["plain"][0]
            rows += [(name, k, ts, ts / base, st if k != "plain" else None) for k, (ts, st) in res.items()]
    table(rows)


if __name__ == "__main__":
    main()
