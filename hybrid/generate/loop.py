"""The single-request generation loop: evaluate the prompt in -b batches, then sample and decode token by token."""

from __future__ import annotations

import time
from collections.abc import Iterator

from hybrid.engine.engine import Engine
from hybrid.errors import ContextTooLarge, HybridError
from hybrid.generate.sampling import Sampler, SamplingParams
from hybrid.generate.timings import Timings
from hybrid.kv.cache import KVCache


def check_fits(n_prompt: int, n_ctx: int, n_past: int = 0) -> None:
    """ContextTooLarge, with the real numbers, unless a prompt of n_prompt tokens fits after the n_past tokens the
    cache holds: checked once before any work (as llama.cpp refuses a prompt too long for -c)."""
    if n_past + n_prompt <= n_ctx:
        return
    if n_past:
        raise ContextTooLarge(f"{n_past} tokens in the cache and a prompt of {n_prompt} make {n_past + n_prompt}, "
                              f"more than the context of {n_ctx} (-c); raise -c or shorten the input")
    raise ContextTooLarge(f"the prompt is {n_prompt} tokens, more than the context of {n_ctx} (-c); "
                          "raise -c or shorten the prompt")


def eval_prompt(engine: Engine, prompt: list[int], cache: KVCache, timings: Timings):
    """The prompt appended to the cache in -b batches -> the last token's logits; HybridError for an empty prompt
    and ContextTooLarge, before anything is evaluated, for one that does not fit. timings counts the prompt's tokens
    and time, even when an eval is interrupted."""
    if not prompt:
        raise HybridError("the prompt is empty")
    check_fits(len(prompt), cache.n_ctx, cache.n_past)
    t0 = time.perf_counter()
    logits = None
    try:
        for s in range(0, len(prompt), engine.params.n_batch):
            batch = prompt[s : s + engine.params.n_batch]
            logits = engine.eval(batch, cache)
            timings.prompt_tokens += len(batch)
    finally:
        timings.prompt_ms += 1000 * (time.perf_counter() - t0)
    return logits


def generate(engine: Engine, prompt: list[int], sampling: SamplingParams, n_predict: int, cache: KVCache,
             timings: Timings | None = None) -> Iterator[int]:
    """Evaluate the prompt (appended to what the cache holds), then sample up to n_predict tokens
    (-1: until the context is full), stopping at an end-of-generation token (not yielded).

    ContextTooLarge before anything is evaluated when the prompt does not fit. The timings count what was done
    even when the caller stops early (Ctrl-C: KeyboardInterrupt inside an eval, or closing the generator)."""
    timings = timings if timings is not None else Timings()
    logits = eval_prompt(engine, prompt, cache, timings)
    sampler = Sampler(sampling)
    history = list(prompt)
    produced = 0
    while n_predict < 0 or produced < n_predict:
        t0 = time.perf_counter()
        try:
            tok = sampler.sample(logits, history)
        finally:
            timings.sample_ms += 1000 * (time.perf_counter() - t0)
        if engine.tokenizer.is_eog(tok):
            return
        yield tok
        produced += 1
        history.append(tok)
        if (n_predict >= 0 and produced >= n_predict) or cache.n_past >= cache.n_ctx:
            return
        t0 = time.perf_counter()
        try:
            logits = engine.eval([tok], cache)
            timings.eval_tokens += 1
        finally:
            timings.eval_ms += 1000 * (time.perf_counter() - t0)
