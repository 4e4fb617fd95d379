"""Replays a routing trace through the cache policies, per layer: the first half of the tokens teaches (the online
policies run through it, the static list counts it), the second half is scored. Each token is one step (as a
decode step): its experts are looked up, then the misses admitted under the cap. Belady is scored on the second
half alone, from its best warm start, with no cap: the bound of the others."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybrid.backends.moe_cache.belady import belady
from hybrid.backends.moe_cache.policy import POLICIES, SlotPool, static_resident
from hybrid.backends.moe_cache.trace import ExpertTrace

ALL_POLICIES = (*POLICIES, "static", "belady")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    n_slots: int  # per layer
    layer_hits: np.ndarray  # (n_layer_moe,) float: hit rate of each layer over the scored tokens
    uploads_per_token: float  # experts inserted per scored token, all layers together

    @property
    def hit_rate(self) -> float:
        """Over every layer (each layer looks up the same number of experts: the mean of the layers')."""
        return float(self.layer_hits.mean())

    def to_json(self) -> dict:
        return {"policy": self.policy, "slots": self.n_slots, "hit_rate": self.hit_rate,
                "uploads_per_token": self.uploads_per_token, "layer_hit_rates": self.layer_hits.tolist()}


def default_slots(top_k: int, n_expert: int) -> list[int]:
    """top_k + 1, 2 top_k, and n_expert / 8, / 4, 3/8, / 2, 3/4, all: those within [top_k + 1, n_expert]."""
    cands = {top_k + 1, 2 * top_k, n_expert} | {n_expert * f // 8 for f in (1, 2, 3, 4, 6)}
    return sorted(s for s in cands if top_k + 1 <= s <= n_expert)


def _online(trace: ExpertTrace, policy: str, n_slots: int, half: int, max_inserts: int | None) -> PolicyResult:
    n_layer = trace.ids.shape[1]
    pool = SlotPool(n_layer, trace.n_expert, trace.top_k, n_slots, policy, max_inserts)
    ids = trace.ids.astype(np.int64)
    for t in range(half):
        pool.access(ids[t])
    hits0, acc0, ins0 = pool.hits.copy(), pool.accesses.copy(), pool.inserts.copy()
    for t in range(half, trace.n_tok):
        pool.access(ids[t])
    scored = trace.n_tok - half
    return PolicyResult(policy, n_slots, (pool.hits - hits0) / np.maximum(pool.accesses - acc0, 1),
                        float((pool.inserts - ins0).sum() / max(scored, 1)))


def _static(trace: ExpertTrace, n_slots: int, half: int) -> PolicyResult:
    resident = static_resident(trace.counts(slice(0, half)), n_slots)  # (n_layer, n_expert)
    ids = trace.ids[half:].astype(np.int64)  # (n, n_layer, k)
    hit = resident[np.arange(ids.shape[1])[None, :, None], ids]
    return PolicyResult("static", n_slots, hit.mean(axis=(0, 2)), 0.0)


def _belady(trace: ExpertTrace, n_slots: int, half: int) -> PolicyResult:
    ids = trace.ids[half:].astype(np.int64)
    rates, inserts = [], 0
    for il in range(ids.shape[1]):
        hit, n_in = belady(ids[:, il], trace.n_expert, n_slots)
        rates.append(hit.mean())
        inserts += n_in
    return PolicyResult("belady", n_slots, np.array(rates), inserts / max(ids.shape[0], 1))


def simulate(trace: ExpertTrace, slots: Sequence[int], policies: Sequence[str] = ALL_POLICIES,
             max_inserts: int | None = None) -> list[PolicyResult]:
    """Each policy at each number of slots per layer (each in [top_k + 1, n_expert]) -> results, slots-major.
    max_inserts caps the online policies' inserts a layer a step (None: no cap)."""
    if trace.n_tok < 2:
        raise ValueError(f"a trace of {trace.n_tok} tokens has no second half to score: record more")
    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad:
        raise ValueError(f"unknown policies {bad}: expected some of {', '.join(ALL_POLICIES)}")
    k, n_expert = trace.top_k, trace.n_expert
    if any(not k + 1 <= s <= n_expert for s in slots):
        raise ValueError(f"slots per layer must lie in [top_k + 1, n_expert] = [{k + 1}, {n_expert}], found "
                         f"{list(slots)}")
    half = trace.n_tok // 2
    out = []
    for s in slots:
        for p in policies:
            if p == "static":
                out.append(_static(trace, s, half))
            elif p == "belady":
                out.append(_belady(trace, s, half))
            else:
                out.append(_online(trace, p, s, half, max_inserts))
    return out
