"""The sampler's top-k (kernels_cpu.topk.top_k_ids) against a full float64 sort: the same ids in the same order,
ties to the lower id (at the k-th place too), NaN below every number, -inf kept in order."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.generate.sampling import Sampler, SamplingParams, top_k
from kernels_cpu.topk import MAX_K, top_k_ids


def _reference(x: np.ndarray, k: int) -> np.ndarray:
    key = np.where(np.isnan(x), -np.inf, x).astype(np.float64)
    return np.lexsort((np.arange(len(x)), -key))[:k]


@pytest.mark.parametrize("seed", range(6))
def test_top_k_ids_equals_a_full_sort(seed):
    rng = np.random.default_rng(seed)
    for trial in range(60):
        n = int(rng.integers(1, 4000))
        k = int(rng.integers(1, min(n, MAX_K) + 1))
        if trial % 3 == 0:  # many ties
            x = rng.integers(-4, 4, n).astype(np.float32)
        else:
            x = rng.standard_normal(n).astype(np.float32)
        if trial % 4 == 0:
            x[rng.integers(0, n, 3)] = np.nan
        if trial % 5 == 0:
            x[rng.integers(0, n, 3)] = -np.inf
        np.testing.assert_array_equal(top_k_ids(x, k), _reference(x, k), err_msg=f"n={n} k={k}")


def test_top_k_ties_at_the_boundary_go_to_the_lower_ids():
    x = np.zeros(1000, dtype=np.float32)
    x[[900, 10, 500]] = 1.0
    ids, vals = top_k(x, 5)
    assert ids.tolist() == [10, 500, 900, 0, 1] and vals.tolist() == [1, 1, 1, 0, 0]


def test_sampler_draws_from_the_same_candidates():
    """The sampler's chain over the compiled top-k draws what it drew over numpy's partition (no ties here)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(262144).astype(np.float32) * 3
    ids, _ = top_k(logits, 40)
    np.testing.assert_array_equal(ids, _reference(logits, 40))
    a, b = Sampler(SamplingParams(seed=7)), Sampler(SamplingParams(seed=7))
    draws = [a.sample(logits) for _ in range(20)]
    assert draws == [b.sample(logits) for _ in range(20)] and set(draws) <= set(ids.tolist())
