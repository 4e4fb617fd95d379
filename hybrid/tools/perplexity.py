"""llama-perplexity's algorithm: chunks of n_ctx tokens from an empty cache, the first token replaced by BOS when
the model adds one (add_bos_token), only the second half scored; PPL = exp(mean NLL), ± as llama.cpp prints it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from hybrid.errors import ContextTooLarge


@dataclass(frozen=True)
class PerplexityStep:
    chunk: int  # 0-based
    n_chunks: int
    ppl: float  # running estimate over chunks 0..chunk
    ppl_err: float
    n_scored: int


def chunk_tokens(tokens: list[int], n_ctx: int, bos_id: int | None, n_chunks: int | None = None) -> list[list[int]]:
    """The evaluated chunks: tokens[k*n_ctx:(k+1)*n_ctx], the first token replaced by bos_id unless it is None
    (llama-perplexity replaces it only for a model that adds BOS: pass None when the tokenizer's add_bos is off)."""
    if n_ctx < 4:
        raise ContextTooLarge(f"perplexity needs a context of at least 4 tokens, got -c {n_ctx}")
    total = len(tokens) // n_ctx
    if total == 0:
        raise ContextTooLarge(
            f"the text has {len(tokens)} tokens, fewer than one chunk of -c {n_ctx}: use a smaller -c or a longer text"
        )
    n = total if n_chunks is None or n_chunks <= 0 else min(total, n_chunks)
    chunks = []
    for k in range(n):
        c = list(tokens[k * n_ctx : (k + 1) * n_ctx])
        if bos_id is not None:
            c[0] = bos_id
        chunks.append(c)
    return chunks


def perplexity(
    chunks: list[list[int]],
    tokens: list[int],
    n_ctx: int,
    logits_of: Callable[[list[int], int], np.ndarray],
) -> Iterator[PerplexityStep]:
    """Score each chunk; `logits_of(chunk, first)` returns the logits of positions first..n_ctx-1, shape (n, n_vocab).

    The target of position j is the original text token tokens[k*n_ctx + j + 1] (not BOS).
    """
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    for k, chunk in enumerate(chunks):
        logits = logits_of(chunk, first)  # (n_ctx - first, n_vocab)
        rows = logits[: n_ctx - 1 - first].astype(np.float64)  # positions first..n_ctx-2
        targets = np.asarray(tokens[k * n_ctx + first + 1 : (k + 1) * n_ctx], dtype=np.int64)
        m = rows.max(axis=1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(rows - m).sum(axis=1)))
        nll = lse - rows[np.arange(len(targets)), targets]
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(targets)
        mean = nll_sum / count
        ppl = math.exp(mean)
        var = nll2_sum / count - mean * mean
        err = ppl * math.sqrt(max(var, 0.0) / (count - 1)) if count > 1 else float("nan")
        yield PerplexityStep(k, len(chunks), ppl, err, count)
