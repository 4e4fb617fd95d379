"""Speculative decoding in `hybrid bench` (--spec-type, -md): a tg N test generates N tokens greedily from a real
prompt, plainly or with drafts, because drafts need text to predict (llama-bench's random tokens would give
nothing to copy). Timed: the generation after the prompt's evaluation (sampling and drafting included); tokens: the
ones after the first (which comes from the prompt's logits), so plain and speculative rows compare directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid.engine.engine import Engine
from hybrid.generate.loop import generate
from hybrid.generate.sampling import SamplingParams
from hybrid.generate.speculative import SpecStats, Speculator
from hybrid.generate.timings import Timings
from hybrid.tools.bench import BenchResult, BenchTest

GREEDY = SamplingParams(temp=0.0)

# The default text of the speculative tests: code whose continuation follows a pattern given in the prompt
# (the case prompt lookup is made for); give any other with `hybrid bench -f FILE`.
CODE_PROMPT = '''class Point:
    def __init__(self, x, y, z, w):
        self._x = x
        self._y = y
        self._z = z
        self._w = w

    def get_x(self):
        return self._x

    def get_y(self):
        return self._y

    def get_'''


@dataclass
class SpecBenchResult(BenchResult):
    spec: SpecStats = field(default_factory=SpecStats)  # totals over the timed repetitions
    n_generated: int = 0  # tokens of the last repetition (an end-of-generation token may stop it early)

    @property
    def samples_ts(self) -> list[float]:
        return [1e9 * max(self.n_generated - 1, 1) / ns for ns in self.samples_ns]


def run_spec_bench(engine: Engine, prompt: list[int], n_gen: int, repetitions: int,
                   make: Callable[[], Speculator | None]) -> SpecBenchResult:
    """tg n_gen from `prompt`, `repetitions` timed runs after an untimed one; make() gives each run its drafter
    (None: plain decoding), fresh so every run starts from the same adaptive state."""
    result = SpecBenchResult(BenchTest(0, n_gen))
    for rep in range(repetitions + 1):
        speculator = make()
        stats = SpecStats()
        timings = Timings()
        cache = engine.new_cache(len(prompt) + n_gen + 1)
        t0 = time.perf_counter_ns()
        if speculator is None:
            out = list(generate(engine, prompt, GREEDY, n_gen, cache, timings))
        else:
            out = list(speculator.generate(engine, prompt, GREEDY, n_gen, cache, timings, stats=stats))
        ns = time.perf_counter_ns() - t0 - int(timings.prompt_ms * 1e6)
        if rep == 0:
            continue  # warm-up: first-use costs of the batch shapes a verification takes
        result.samples_ns.append(ns)
        result.spec.merge(stats)
        result.n_generated = len(out)
    return result
