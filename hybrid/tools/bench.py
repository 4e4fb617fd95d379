"""llama-bench's measurements: pp (prompt processing), tg (text generation), pg (both) in tokens/s.

Tokenization and sampling are excluded (random token ids are fed, as llama-bench does); a warm-up run comes
first; each repetition starts from an empty KV cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from hybrid.engine.engine import Engine


@dataclass(frozen=True)
class BenchTest:
    n_prompt: int
    n_gen: int

    @property
    def name(self) -> str:
        if self.n_prompt and self.n_gen:
            return f"pp{self.n_prompt}+tg{self.n_gen}"
        return f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"


@dataclass
class BenchResult:
    test: BenchTest
    samples_ns: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return self.test.n_prompt + self.test.n_gen

    @property
    def samples_ts(self) -> list[float]:
        return [1e9 * self.n_tokens / ns for ns in self.samples_ns]

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ns) > 1 else 0.0

    @property
    def avg_ns(self) -> int:
        return int(statistics.fmean(self.samples_ns))

    @property
    def stddev_ns(self) -> int:
        return int(statistics.stdev(self.samples_ns)) if len(self.samples_ns) > 1 else 0


def tests_from(n_prompt: list[int], n_gen: list[int], pg: list[tuple[int, int]]) -> list[BenchTest]:
    tests = [BenchTest(p, 0) for p in n_prompt if p > 0]
    tests += [BenchTest(0, n) for n in n_gen if n > 0]
    tests += [BenchTest(p, n) for p, n in pg]
    return tests


def _cache_cells(test: BenchTest) -> int:
    return max(test.n_prompt + test.n_gen + 1, 16)


def _run_once(engine: Engine, test: BenchTest, rng: np.random.Generator, n_cells: int | None = None) -> int:
    """One timed run of test from an empty cache of n_cells (default: the test's own size)."""
    n_vocab = engine.config.n_vocab
    cache = engine.new_cache(_cache_cells(test) if n_cells is None else n_cells)
    bos = engine.tokenizer.bos_id if engine.tokenizer.bos_id is not None else 0
    t0 = time.perf_counter_ns()
    if test.n_prompt:
        tokens = rng.integers(0, n_vocab, test.n_prompt)
        tokens[0] = bos
        for s in range(0, test.n_prompt, engine.params.n_batch):
            engine.eval(tokens[s : s + engine.params.n_batch], cache)
    if test.n_gen:
        tok = bos
        for _ in range(test.n_gen):
            engine.eval([tok], cache)
            tok = int(rng.integers(0, n_vocab))
    return time.perf_counter_ns() - t0


def run_bench(engine: Engine, tests: list[BenchTest], repetitions: int, warmup: bool = True,
              on_sample: Callable[[BenchTest, int], None] | None = None) -> Iterator[BenchResult]:
    """One BenchResult per test, each with `repetitions` timed samples after an untimed warm-up run."""
    rng = np.random.default_rng(1234)
    for test in tests:
        if warmup:  # as llama-bench: the whole prompt (first-use costs of its buffer sizes), a few generated tokens,
            # in a cache of the timed runs' size (as llama-bench's one context): their decode graphs are captured here
            _run_once(engine, BenchTest(test.n_prompt, min(test.n_gen, 4)), rng, _cache_cells(test))
        result = BenchResult(test)
        for _ in range(repetitions):
            result.samples_ns.append(_run_once(engine, test, rng))
            if on_sample:
                on_sample(test, result.samples_ns[-1])
        yield result
