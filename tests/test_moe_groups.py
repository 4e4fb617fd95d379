"""kernels_gpu.moe's grouping of (token, expert) pairs for the batched expert GEMMs (host code: no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu.moe import _groups


@pytest.mark.parametrize("n_tok,n_expert,k", [(9, 16, 4), (64, 128, 8), (512, 128, 8), (10, 8, 8), (33, 4, 1)])
def test_every_pair_has_one_row_of_its_expert(n_tok, n_expert, k):
    rng = np.random.default_rng(n_tok)
    logits = rng.standard_normal((n_tok, n_expert)) * np.linspace(0.1, 3, n_expert)  # skewed, as real routers
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    bins, src, dest = _groups(ids)
    expert_of_row = np.full(src.shape[0], -1)
    for experts, m, row in bins:
        counts = [int((ids == e).sum()) for e in experts]
        assert counts[0] == m and all(m >= c and 2 * c >= m for c in counts)  # padding at most doubles a group
        for i, e in enumerate(experts):
            expert_of_row[row + i * m:row + (i + 1) * m] = e
    flat = ids.reshape(-1)
    assert len(set(dest.tolist())) == flat.size  # one row per pair
    assert np.array_equal(src[dest], np.arange(flat.size) // k)  # ... holding its token
    assert np.array_equal(expert_of_row[dest], flat)  # ... in its expert's group
    assert int((src >= 0).sum()) == flat.size  # every other row is padding
    assert src.shape[0] <= 2 * flat.size
