"""A routing trace in numbers, per MoE layer: the share of the routed slots the busiest C experts take (C = k, 2k,
n_expert / 4: what a cache of that many slots would hold at best, statically) and the routing entropy (bits, and
over log2 n_expert: 1 is an even spread, 0 one expert); and their means over the layers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid.backends.moe_cache.trace import ExpertTrace

N_TOP_SHOWN = 4  # busiest experts named per layer


@dataclass(frozen=True)
class LayerRouting:
    layer: int  # the model's layer index
    counts: np.ndarray  # (n_expert,) int64: slots each expert took
    shares: tuple[float, ...]  # the top-C experts' share of the slots, for each C of RoutingSummary.cs
    entropy_bits: float
    entropy_norm: float  # entropy_bits / log2(n_expert)

    @property
    def busiest(self) -> list[tuple[int, int]]:
        """(expert, slots) of the N_TOP_SHOWN busiest experts, busiest first (ties: the lower expert)."""
        order = np.argsort(-self.counts, kind="stable")[:N_TOP_SHOWN]
        return [(int(e), int(self.counts[e])) for e in order]


@dataclass(frozen=True)
class RoutingSummary:
    model: str
    n_tok: int
    n_expert: int
    top_k: int
    cs: tuple[int, ...]  # the C of each share
    layers: list[LayerRouting]

    @property
    def mean_shares(self) -> tuple[float, ...]:
        return tuple(float(np.mean([lr.shares[i] for lr in self.layers])) for i in range(len(self.cs)))

    @property
    def mean_entropy_bits(self) -> float:
        return float(np.mean([lr.entropy_bits for lr in self.layers]))

    @property
    def mean_entropy_norm(self) -> float:
        return float(np.mean([lr.entropy_norm for lr in self.layers]))

    def to_json(self) -> dict:
        return {"model": self.model, "n_tok": self.n_tok, "n_expert": self.n_expert, "top_k": self.top_k,
                "top_c": list(self.cs),
                "overall": {"top_share": dict(zip(map(str, self.cs), self.mean_shares)),
                            "entropy_bits": self.mean_entropy_bits, "entropy_norm": self.mean_entropy_norm},
                "layers": [{"layer": lr.layer, "top_share": dict(zip(map(str, self.cs), lr.shares)),
                            "entropy_bits": lr.entropy_bits, "entropy_norm": lr.entropy_norm,
                            "busiest": [list(b) for b in lr.busiest], "counts": lr.counts.tolist()}
                           for lr in self.layers]}


def top_cs(top_k: int, n_expert: int) -> tuple[int, ...]:
    """k, 2k and n_expert / 4, each at most n_expert, without repeats, ascending."""
    return tuple(sorted({min(c, n_expert) for c in (top_k, 2 * top_k, max(1, n_expert // 4))}))


def top_share(counts: np.ndarray, c: int) -> float:
    """The share of all slots the c busiest experts took (counts (n_expert,))."""
    total = counts.sum()
    return float(np.sort(counts)[::-1][:c].sum() / total) if total else 0.0


def entropy_bits(counts: np.ndarray) -> float:
    """-sum p log2 p of the experts' shares of the slots (0 log 0 = 0)."""
    total = counts.sum()
    if not total:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def routing_summary(trace: ExpertTrace) -> RoutingSummary:
    cs = top_cs(trace.top_k, trace.n_expert)
    log_n = np.log2(trace.n_expert) if trace.n_expert > 1 else 1.0
    layers = []
    for il, counts in zip(trace.layers.tolist(), trace.counts()):
        h = entropy_bits(counts)
        layers.append(LayerRouting(il, counts, tuple(top_share(counts, c) for c in cs), h, float(h / log_n)))
    return RoutingSummary(trace.model, trace.n_tok, trace.n_expert, trace.top_k, cs, layers)
