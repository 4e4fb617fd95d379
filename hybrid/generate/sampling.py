"""Token sampling with llama.cpp's default chain: penalties -> top-k -> top-p -> min-p -> temperature -> draw.

Greedy (`temp <= 0`) is an argmax. Top-k is one compiled pass over the logits (kernels_cpu.topk), so 262k logits
are never sorted, nor copied.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from kernels_cpu.topk import MAX_K as TOPK_MAX_K
from kernels_cpu.topk import top_k_ids


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temp: float = 0.8
    top_k: int = 40  # <= 0: whole vocabulary
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # how many recent tokens the penalties look at (-1: all, 0: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: a random seed

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


class Sampler:
    """Holds the random generator for one generation; `sample(logits, history)` returns a token id."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(None if params.seed < 0 else params.seed)

    @property
    def argmax_only(self) -> bool:
        """Whether every draw is the largest logit's id as the model gives it (greedy, and no penalty applies):
        the engine may then hand over that id alone (Engine.eval_batch's ids)."""
        p = self.params
        return p.greedy and (p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                                                      and p.frequency_penalty == 0.0))

    def sample(self, logits: np.ndarray, history: list[int] | tuple[int, ...] = ()) -> int:
        """logits: (n_vocab,) float32; history: the prompt and generated tokens so far."""
        p = self.params
        logits = apply_penalties(logits, history, p)
        if p.greedy:
            return int(np.argmax(logits))
        ids, vals = top_k(logits, p.top_k)  # sorted descending
        probs = _softmax(vals.astype(np.float64))
        n = _top_p_keep(probs, p.top_p)
        if p.min_p > 0.0:
            n = min(n, max(1, int(np.count_nonzero(probs[:n] >= p.min_p * probs[0]))))
        ids, vals = ids[:n], vals[:n]
        probs = _softmax(vals.astype(np.float64) / p.temp)
        return int(ids[self.rng.choice(len(ids), p=probs)])


def apply_penalties(logits: np.ndarray, history, p: SamplingParams) -> np.ndarray:
    """Repeat (divide positive / multiply negative logits), presence and frequency penalties over the last n tokens."""
    if (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0) or p.repeat_last_n == 0:
        return logits
    recent = list(history) if p.repeat_last_n < 0 else list(history)[-p.repeat_last_n :]
    if not recent:
        return logits
    out = logits.copy()
    counts = Counter(recent)
    ids = np.fromiter(counts.keys(), dtype=np.int64)
    freq = np.fromiter(counts.values(), dtype=np.float32)
    vals = out[ids]
    vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    out[ids] = vals - freq * p.frequency_penalty - p.presence_penalty
    return out


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits and their ids, sorted descending (ties: lower id first). float32 logits and k up to
    kernels_cpu.topk.MAX_K: one compiled pass (top_k_ids); else numpy's partition of the whole vocabulary."""
    n = logits.shape[0]
    if 0 < k < n and k <= TOPK_MAX_K and logits.dtype == np.float32 and logits.ndim == 1:
        ids = top_k_ids(np.ascontiguousarray(logits), k)
        return ids, logits[ids]
    if 0 < k < n:
        part = np.argpartition(-logits, k - 1)[:k]
    else:
        part = np.arange(n)
    order = np.lexsort((part, -logits[part]))
    ids = part[order]
    return ids, logits[ids]


def _top_p_keep(probs_sorted: np.ndarray, top_p: float) -> int:
    if top_p >= 1.0:
        return len(probs_sorted)
    cum = np.cumsum(probs_sorted / probs_sorted.sum())
    return int(min(len(probs_sorted), np.searchsorted(cum, top_p) + 1))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64: (..., n_vocab) -> (..., n_vocab)."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
