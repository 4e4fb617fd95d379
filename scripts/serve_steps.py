#!/usr/bin/env python3
"""`hybrid serve` with a log of its worker's steps: each Engine.eval_batch the batched worker runs is written to
--log (one JSON line: start time in s since the epoch, the tokens each sequence evaluated, which of them were
prompt rows, ms), and `--summary FILE` prints a log's steps grouped by what they held: decode rows alone, or prompt
rows (how many prompts, rows, decode rows beside them), with their counts and mean ms. What a load's prefill steps look like
(one wave of prompts in one step, or a lone prompt, then the rest beside its first decode) is read there.

    python3 scripts/serve_steps.py --log steps.jsonl -- MODEL -ngl 99 -np 8 [any hybrid serve flag]
    python3 scripts/serve_steps.py --summary steps.jsonl [--after EPOCH_S]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict


def traced(run_step, log):
    """run_step (hybrid.server.scheduler's) that writes each step it runs to the open file `log`."""

    def step(engine, work, counters, beside=None):
        rows = [(n, bool(s.remaining)) for s, n in work if n]
        t_wall, t0 = time.time(), time.perf_counter()
        events = run_step(engine, work, counters, beside)
        ms = 1000 * (time.perf_counter() - t0)
        if rows:
            log.write(json.dumps({"t": round(t_wall, 6), "rows": [n for n, _ in rows],
                                  "prompt": [p for _, p in rows], "ms": round(ms, 3)}) + "\n")
            log.flush()
        return events

    return step


def kind(rec: dict) -> tuple:
    """(prompts, prompt rows, decode rows) of a step."""
    p = [n for n, is_p in zip(rec["rows"], rec["prompt"]) if is_p]
    return len(p), sum(p), len(rec["rows"]) - len(p)


def summary(path: str, after: float = 0.0) -> str:
    """The steps of the log at `path` that began after `after` (s since the epoch), by kind."""
    recs = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    recs = [r for r in recs if r["t"] >= after]
    if not recs:
        return f"{path}: no steps"
    groups = defaultdict(list)
    for r in recs:
        groups[kind(r)].append(r["ms"])
    out = [f"{len(recs)} steps over {recs[-1]['t'] - recs[0]['t'] + recs[-1]['ms'] / 1000:.2f} s, "
           f"{sum(r['ms'] for r in recs) / 1000:.2f} s in steps", "",
           "| prompts | prompt rows | decode rows | steps | ms a step, mean | min | max | ms in all |",
           "|---|---|---|---|---|---|---|---|"]
    for (n_p, rows, dec), ms in sorted(groups.items(), key=lambda kv: (kv[0][0] == 0, -sum(kv[1]))):
        out.append(f"| {n_p} | {rows} | {dec} | {len(ms)} | {sum(ms) / len(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} "
                   f"| {sum(ms):.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", help="write the steps here (JSON lines) while serving")
    ap.add_argument("--summary", help="print this log's steps by kind, and exit")
    ap.add_argument("--after", type=float, default=0.0, help="with --summary: the steps begun after this time (s since "
                    "the epoch, as `date +%%s.%%N` prints it)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then hybrid serve's arguments")
    a = ap.parse_args()
    if a.summary:
        print(summary(a.summary, a.after))
        return 0
    if not a.log:
        ap.error("give --log FILE -- SERVE ARGS, or --summary FILE")
    args = a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args
    import hybrid.server.paged_scheduler as paged  # noqa: PLC0415
    import hybrid.server.scheduler as sched  # noqa: PLC0415
    from hybrid.cli.main import run  # noqa: PLC0415

    with open(a.log, "w", encoding="utf-8") as log:
        paged.run_step = sched.run_step = traced(sched.run_step, log)
        sys.argv = ["hybrid", "serve", *args]
        run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
