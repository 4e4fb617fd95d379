"""llama-batched-bench's measurement: B sequences of PP prompt tokens each are prefilled together (the -b budget per
step, as one ragged batch), then decoded together for TG steps of one token per sequence. Random token ids, no
sampling; each sequence has its own KV cache (Engine.eval_batch: paged sequences of one pool on the CPU, as the
server's); a warm-up test runs first."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from hybrid.engine.engine import Engine
from hybrid.kv.paged import DEFAULT_BLOCK_SIZE, PagedKV, supports_paging


@dataclass(frozen=True)
class BatchedRow:
    pp: int
    tg: int
    b: int
    t_pp: float  # seconds
    t_tg: float

    @property
    def n_kv(self) -> int:
        return self.b * (self.pp + self.tg)

    @property
    def s_pp(self) -> float:
        return self.b * self.pp / self.t_pp if self.t_pp > 0 else 0.0

    @property
    def s_tg(self) -> float:
        return self.b * self.tg / self.t_tg if self.t_tg > 0 else 0.0

    @property
    def t(self) -> float:
        return self.t_pp + self.t_tg

    @property
    def s(self) -> float:
        return self.n_kv / self.t if self.t > 0 else 0.0


def _prefill(engine: Engine, prompts: list[np.ndarray], caches: list, n_batch: int) -> None:
    """Every prompt into its cache, n_batch tokens a step, filled in sequence order (chunked)."""
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        batch, want, left = [], [], n_batch
        for i, (p, c) in enumerate(zip(prompts, caches)):
            n = min(len(p) - done[i], left)
            if n > 0:
                batch.append((p[done[i] : done[i] + n], c))
                want.append(done[i] + n == len(p))
                done[i] += n
                left -= n
        engine.eval_batch(batch, want)


def _caches(engine: Engine, b: int, n_ctx: int) -> list:
    """b caches of n_ctx cells: paged sequences of one pool, as `hybrid serve -np N` has (llama.cpp's unified KV
    cache), where every layer's backend reads block tables (the CPU's, the GPU's); else a contiguous cache each."""
    if not supports_paging(engine.backends):
        return [engine.new_cache(n_ctx) for _ in range(b)]
    p = engine.params
    kv = PagedKV(engine.config, engine.backends, b * -(-n_ctx // DEFAULT_BLOCK_SIZE), DEFAULT_BLOCK_SIZE, p.type_k,
                 p.type_v)
    return [kv.sequence(n_ctx) for _ in range(b)]


def run_one(engine: Engine, pp: int, tg: int, b: int, n_batch: int, rng: np.random.Generator) -> BatchedRow:
    vocab = engine.config.n_vocab
    caches = _caches(engine, b, pp + tg)
    prompts = [rng.integers(0, vocab, pp) for _ in range(b)]
    t0 = time.perf_counter()
    if pp:
        _prefill(engine, prompts, caches, n_batch)
    t1 = time.perf_counter()
    for _ in range(tg):
        engine.eval_batch([(rng.integers(0, vocab, 1), c) for c in caches])
    t2 = time.perf_counter()
    return BatchedRow(pp, tg, b, t1 - t0, t2 - t1)


def run_batched(engine: Engine, pps: list[int], tgs: list[int], bs: list[int], n_batch: int,
                seed: int = 0) -> Iterator[BatchedRow]:
    """One row per (pp, tg, b), in llama-batched-bench's order (pp outermost, then tg, then b), after a warm-up."""
    rng = np.random.default_rng(seed)
    run_one(engine, min(pps), 2, max(bs), n_batch, rng)  # compile and touch what the tests use
    for pp in pps:
        for tg in tgs:
            for b in bs:
                yield run_one(engine, pp, tg, b, n_batch, rng)


HEADER = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


def table_row(r: BatchedRow) -> tuple[str, ...]:
    return (str(r.pp), str(r.tg), str(r.b), str(r.n_kv), f"{r.t_pp:.3f}", f"{r.s_pp:.2f}", f"{r.t_tg:.3f}",
            f"{r.s_tg:.2f}", f"{r.t:.3f}", f"{r.s:.2f}")


def markdown(rows: list[tuple[str, ...]], out: Callable[[str], None]) -> None:
    """llama-batched-bench's table, a line at a time (rows: table_row's)."""
    widths = [max(len(h), 6, *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)] if rows else \
        [max(len(h), 6) for h in HEADER]
    out("|" + "|".join(f" {h:>{w}} " for h, w in zip(HEADER, widths)) + "|")
    out("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        out("|" + "|".join(f" {v:>{w}} " for v, w in zip(r, widths)) + "|")
