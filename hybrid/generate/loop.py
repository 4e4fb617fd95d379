"""The single-request generation loop: evaluate the prompt in -b batches, then sample and decode token by token."""

from __future__ import annotations

import time
from collections.abc import Iterator

from hybrid.engine.engine import Engine
from hybrid.errors import HybridError
from hybrid.generate.sampling import Sampler, SamplingParams
from hybrid.generate.timings import Timings
from hybrid.kv.cache import KVCache


def generate(engine: Engine, prompt: list[int], sampling: SamplingParams, n_predict: int, cache: KVCache,
             timings: Timings | None = None) -> Iterator[int]:
    """Evaluate the prompt (appended to what the cache holds), then sample up to n_predict tokens
    (-1: until the context is full), stopping at an end-of-generation token (not yielded)."""
    timings = timings if timings is not None else Timings()
    if not prompt:
        raise HybridError("the prompt is empty")
    sampler = Sampler(sampling)
    history = list(prompt)
    t0 = time.perf_counter()
    logits = None
    for s in range(0, len(prompt), engine.params.n_batch):
        logits = engine.eval(prompt[s : s + engine.params.n_batch], cache)
    timings.prompt_ms += 1000 * (time.perf_counter() - t0)
    timings.prompt_tokens += len(prompt)
    produced = 0
    while n_predict < 0 or produced < n_predict:
        t0 = time.perf_counter()
        tok = sampler.sample(logits, history)
        timings.sample_ms += 1000 * (time.perf_counter() - t0)
        if engine.tokenizer.is_eog(tok):
            return
        yield tok
        produced += 1
        history.append(tok)
        if (n_predict >= 0 and produced >= n_predict) or cache.n_past >= cache.n_ctx:
            return
        t0 = time.perf_counter()
        logits = engine.eval([tok], cache)
        timings.eval_ms += 1000 * (time.perf_counter() - t0)
        timings.eval_tokens += 1
