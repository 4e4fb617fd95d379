"""Benchmark hybrid.text.tokenizer: vocab setup time and tokenize/detokenize time of gpl3.txt (median of N runs).

    python3 scripts/bench_tokenizer.py [--model PATH] [--text PATH] [-n RUNS]

Defaults: the Gemma 3 270M demo model ($HYBRID_DEMO_MODEL or ~/.cache/hybrid/gemma-3-270m-q4_k_m.gguf)
and tests/fixtures/gemma-3-270m/gpl3.txt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf_io import open_gguf  # noqa: E402
from hybrid.text.tokenizer import Tokenizer  # noqa: E402

DEFAULT_TEXT = ROOT / "tests" / "fixtures" / "gemma-3-270m" / "gpl3.txt"


def _default_model() -> Path:
    env = os.environ.get("HYBRID_DEMO_MODEL")
    return Path(env) if env else Path.home() / ".cache" / "hybrid" / "gemma-3-270m-q4_k_m.gguf"


def _median_time(fn, runs: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=_default_model())
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("-n", "--runs", type=int, default=5)
    args = ap.parse_args()

    t0 = time.perf_counter()
    with open_gguf(args.model) as f:
        metadata = dict(f.metadata)
    t_meta = time.perf_counter() - t0
    t_vocab, tok = _median_time(lambda: Tokenizer.from_metadata(metadata), max(1, args.runs // 2))
    text = args.text.read_text(encoding="utf-8")

    t_first, _ = _median_time(lambda: tok.encode(text), 1)
    t_enc, ids = _median_time(lambda: tok.encode(text), args.runs)
    t_dec, out = _median_time(lambda: tok.decode(ids, remove_special=True), args.runs)

    print(f"model      {args.model.name}: {tok!r}")
    print(f"metadata   {t_meta * 1e3:8.1f} ms  (gguf_io.open_gguf)")
    print(f"vocab      {t_vocab * 1e3:8.1f} ms  (Tokenizer.from_metadata, median of {max(1, args.runs // 2)})")
    print(f"text       {args.text.name}: {len(text.encode('utf-8'))} bytes -> {len(ids)} tokens")
    print(f"encode     {t_enc * 1e3:8.1f} ms  (median of {args.runs}; first call {t_first * 1e3:.1f} ms)"
          f"  {len(ids) / t_enc:,.0f} tokens/s")
    print(f"decode     {t_dec * 1e3:8.1f} ms  (median of {args.runs})  round trip exact: {out == text}")


if __name__ == "__main__":
    main()
