"""The table of a session script's alternated runs: OUT/{hybrid,llama}_{SETTING}_{ROUND}.json (hybrid bench and
llama-bench `-o json`), one row per (setting, test) with every round's t/s and the ratio of the means.

    python3 scripts/bench_summary.py OUT [--label placement]
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the directory of the JSON files")
    ap.add_argument("--label", default="setting", help="the first column's header")
    a = ap.parse_args(argv)
    rows: dict = {}
    files = glob.glob(os.path.join(a.out, "hybrid_*_*.json")) + glob.glob(os.path.join(a.out, "llama_*_*.json"))
    for f in sorted(files):
        who, setting, _ = os.path.basename(f)[:-5].split("_", 2)
        try:
            data = json.load(open(f))
        except Exception as exc:  # noqa: BLE001 - a run that failed: said, the others still tabled
            print(f"{os.path.basename(f)}: {type(exc).__name__}")
            continue
        for r in data:
            test = r.get("test") or (f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}")
            rows.setdefault((setting, test), {}).setdefault(who, []).append(r["avg_ts"])
    print(f"| {a.label} | test | hybrid t/s (rounds) | llama.cpp t/s (rounds) | ratio of means |")
    print("|---|---|---|---|---|")
    for (setting, test), d in sorted(rows.items()):
        h, lc = d.get("hybrid", []), d.get("llama", [])
        ratio = f"{(sum(h) / len(h)) / (sum(lc) / len(lc)):.2f}" if h and lc else ""
        print(f"| {setting} | {test} | {' / '.join(f'{v:.1f}' for v in h)} | {' / '.join(f'{v:.1f}' for v in lc)} "
              f"| {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
