"""tg tokens/s, plain vs n-gram speculative decoding, on the demo model in one process (greedy).

python scripts/bench_spec.py [-n 96] [--reps 3]   prints one row per prompt: plain t/s, ngram t/s, ratio, acceptance.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import _demo_model  # noqa: E402
from test_speculative import REPETITIVE  # noqa: E402

from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.draft import NgramDrafter  # noqa: E402
from hybrid.generate.loop import generate  # noqa: E402
from hybrid.generate.sampling import SamplingParams  # noqa: E402
from hybrid.generate.speculative import SpecStats, generate_speculative  # noqa: E402
from hybrid.generate.timings import Timings  # noqa: E402

FREE = "The history of the lighthouse keepers on the northern coast is a story of"
GREEDY = SamplingParams(temp=0.0)


def tg(engine, ids, n, spec: bool, adaptive: bool) -> tuple[float, SpecStats]:
    t, st = Timings(), SpecStats()
    it = (generate_speculative(engine, ids, GREEDY, n, engine.new_cache(), NgramDrafter(), 8, 1, t, st, adaptive)
          if spec else generate(engine, ids, GREEDY, n, engine.new_cache(), t))
    t0 = time.perf_counter()
    out = list(it)
    dt = time.perf_counter() - t0 - t.prompt_ms / 1000
    return (len(out) - 1) / dt, st  # the first token comes from the prompt's logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    engine = Engine.load(_demo_model(), EngineParams(n_ctx=1024))
    engine.warmup()
    print(f"{'prompt':<12} {'plain t/s':>9} {'ngram t/s':>9} {'ratio':>6} {'fixed-8':>8} {'ratio':>6} {'accept':>6}")
    for name, text in (("repetitive", REPETITIVE), ("free-form", FREE)):
        ids = engine.tokenizer.encode(text, add_special=True, parse_special=True)
        best = {}
        for _ in range(a.reps):  # interleaved, best of reps
            for key, spec, adaptive in (("plain", False, False), ("ngram", True, True), ("fixed", True, False)):
                r, st = tg(engine, ids, a.n, spec, adaptive)
                if r > best.get(key, (0, None))[0]:
                    best[key] = (r, st)
        p, g, f = best["plain"][0], best["ngram"][0], best["fixed"][0]
        print(f"{name:<12} {p:9.2f} {g:9.2f} {g / p:6.2f} {f:8.2f} {f / p:6.2f} {best['fixed'][1].rate:6.2f}")


if __name__ == "__main__":
    main()
