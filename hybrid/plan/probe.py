"""The pure half of `hybrid probe`: predict the largest -ngl from the plan, find the real ceiling with few
allocation attempts (the caller's `fits(ngl)` allocates and reports out-of-memory as False), recommend a value
that leaves a margin, and compare KV cache types. No hardware here: the allocator is a callback.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from gguf_io import ModelConfig

from hybrid.errors import PlacementError
from hybrid.plan.budget import PlanInputs, plan_for
from hybrid.plan.placement import PlacementPlan, kv_bytes_per_cell, kv_cells
from hybrid.system.sizes import GiB

DEFAULT_MARGIN_BYTES = GiB
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Prediction:
    ngl: int  # the largest -ngl whose plan fits budget - margin
    n_offloadable: int  # n_layer + 1
    gpu_bytes: int  # GPU bytes of that plan
    next_gpu_bytes: int | None  # GPU bytes of one more layer; None when everything fits
    budget_bytes: int
    margin_bytes: int


@dataclass(frozen=True)
class CeilingSearch:
    ceiling: int  # the largest n in [lo, hi] with fits(n); lo - 1 when none
    predicted: int
    attempts: tuple[tuple[int, bool], ...]  # (ngl, fitted) in call order, each ngl once

    @property
    def calls(self) -> int:
        return len(self.attempts)


@dataclass(frozen=True)
class Recommendation:
    ngl: int  # the largest -ngl <= ceiling whose plan leaves >= margin_bytes of headroom (0 at worst)
    ceiling: int
    margin_bytes: int
    headroom_bytes: int  # of the recommended plan
    gpu_bytes: int
    limited_by: str  # "ceiling" (the measured limit already leaves the margin) or "margin"


@dataclass(frozen=True)
class KVTypeRow:
    type_k: str
    type_v: str
    kv_bytes: int  # the KV cache of every layer at n_ctx
    max_ngl: int  # predicted, no margin
    safe_ngl: int  # predicted with the margin
    extra_layers: int  # max_ngl minus the first row's (f16): how many more layers this type buys


def predict_max_ngl(config: ModelConfig, tensors: Mapping, budget_bytes: int, inputs: PlanInputs,
                    margin: int = 0) -> Prediction:
    """The plan's largest -ngl for budget_bytes - margin, and what it and one more layer would take."""
    p = plan_for(config, tensors, max(0, budget_bytes - margin), "auto", inputs)
    k, n_max = p.n_gpu_layers, config.n_layer + 1
    nxt = plan_for(config, tensors, _UNLIMITED, k + 1, inputs).gpu_total_bytes if k < n_max else None
    return Prediction(k, n_max, p.gpu_total_bytes, nxt, budget_bytes, margin)


def bisect_ceiling(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n) True, assuming fits is True up to a point and False after it.

    lo - 1 when fits(lo) is False. ceil(log2(hi - lo + 2)) calls at most, none repeated.
    """
    if hi < lo:
        raise ValueError(f"bisect_ceiling needs lo <= hi, found lo={lo}, hi={hi}")
    return _bisect(fits, lo - 1, hi + 1)


def _bisect(fits: Callable[[int], bool], good: int, bad: int) -> int:
    """good fits (or is lo - 1), bad does not (or is hi + 1): narrow the gap to 1, return good."""
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def find_ceiling(fits: Callable[[int], bool], predicted: int, hi: int, lo: int = 0) -> CeilingSearch:
    """bisect_ceiling, starting at the prediction: 2 calls when it is right, O(log distance) when it is not.

    Checks `predicted` (clamped to [lo, hi]); then gallops away from it (steps 1, 2, 4, ...) until the
    answer changes, and bisects the last step. Each n is tried at most once.
    """
    if hi < lo:
        raise ValueError(f"find_ceiling needs lo <= hi, found lo={lo}, hi={hi}")
    attempts: list[tuple[int, bool]] = []
    seen: dict[int, bool] = {}

    def tried(n: int) -> bool:
        if n not in seen:
            seen[n] = bool(fits(n))
            attempts.append((n, seen[n]))
        return seen[n]

    p = min(max(predicted, lo), hi)
    step = 1
    if tried(p):
        good, bad = p, hi + 1
        while good < hi:
            n = min(good + step, hi)
            if not tried(n):
                bad = n
                break
            good, step = n, step * 2
    else:
        good, bad = lo - 1, p
        while bad > lo:
            n = max(bad - step, lo)
            if tried(n):
                good = n
                break
            bad, step = n, step * 2
    return CeilingSearch(_bisect(tried, good, bad), predicted, tuple(attempts))


def recommend(ceiling: int, plan_fn: Callable[[int], PlacementPlan],
              margin_bytes: int = DEFAULT_MARGIN_BYTES) -> Recommendation:
    """The largest -ngl <= ceiling whose plan (plan_fn(ngl), e.g. for the device's free memory) leaves
    margin_bytes of headroom; a plan_fn raising PlacementError counts as no headroom. 0 when nothing does."""

    def leaves_margin(n: int) -> bool:
        try:
            return plan_fn(n).headroom_bytes >= margin_bytes
        except PlacementError:
            return False

    ceiling = max(ceiling, 0)
    ngl = max(bisect_ceiling(leaves_margin, 0, ceiling), 0)
    try:
        p = plan_fn(ngl)
        headroom, gpu = p.headroom_bytes, p.gpu_total_bytes
    except PlacementError:  # only ngl 0 can get here, and a budget-free plan for 0 does not raise
        headroom, gpu = 0, 0
    return Recommendation(ngl, ceiling, margin_bytes, headroom, gpu, "ceiling" if ngl == ceiling else "margin")


def kv_type_table(config: ModelConfig, tensors: Mapping, budget_bytes: int, inputs: PlanInputs,
                  types: Sequence[str] = ("f16", "q8_0", "q4_0"),
                  margin_bytes: int = DEFAULT_MARGIN_BYTES) -> tuple[KVTypeRow, ...]:
    """Per KV cache type (K and V alike, the other flags as `inputs`): the cache size at n_ctx, the predicted
    -ngl with and without the margin, and how many more layers it buys than the first type."""
    rows: list[KVTypeRow] = []
    for t in types:
        per_cell = kv_bytes_per_cell(config, t, t)
        kv = sum(kv_cells(config, il, inputs.n_ctx, inputs.n_ubatch, True) for il in range(config.n_layer)) * per_cell
        typed = replace(inputs, type_k=t, type_v=t)
        top = predict_max_ngl(config, tensors, budget_bytes, typed).ngl
        safe = predict_max_ngl(config, tensors, budget_bytes, typed, margin_bytes).ngl
        rows.append(KVTypeRow(t, t, kv, top, safe, top - (rows[0].max_ngl if rows else top)))
    return tuple(rows)
