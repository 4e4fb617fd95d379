"""kernels_gpu.moe's grouping of (token, expert) pairs for the batched expert GEMMs (host code: no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu.moe import PAD_FREE_ROWS, _bucket, _groups


@pytest.mark.parametrize("n_tok,n_expert,k", [(9, 16, 4), (64, 128, 8), (512, 128, 8), (10, 8, 8), (33, 4, 1)])
@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_every_pair_has_one_row_of_its_expert(n_tok, n_expert, k, skew):
    rng = np.random.default_rng(n_tok)
    logits = rng.standard_normal((n_tok, n_expert)) * np.linspace(0.1, 3, n_expert)  # uneven, as real routers
    logits[:, : n_expert // 8] += skew  # a few hot experts most tokens pick (synthetic models route so)
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    runs, src, dest = _groups(ids, max_run=24)
    expert_of_row = np.full(src.shape[0], -1)
    ends = [0]
    for e0, e1, m, row in runs:
        counts = [int((ids == e).sum()) for e in range(e0, e1)]
        assert 0 < e1 - e0 <= 24 and counts[0] > 0 and counts[-1] > 0 and row == ends[-1]
        assert m == _bucket(max(counts)) and m < 1.25 * max(counts) + 8  # a few shapes, little padding
        assert max(counts) <= PAD_FREE_ROWS or max(counts) * len(counts) <= 2 * sum(counts)  # bounded padding
        ends.append(row + m * (e1 - e0))
        for e in range(e0, e1):
            expert_of_row[row + (e - e0) * m:row + (e - e0 + 1) * m] = e
    covered = np.concatenate([np.arange(e0, e1) for e0, e1, _, _ in runs])
    assert np.all(np.diff(covered) > 0) and set(np.unique(ids)) <= set(covered.tolist())  # every used expert once
    flat = ids.reshape(-1)
    assert len(set(dest.tolist())) == flat.size  # one row per pair
    assert np.array_equal(src[dest], np.arange(flat.size) // k)  # ... holding its token
    assert np.array_equal(expert_of_row[dest], flat)  # ... in its expert's group
    assert int((src >= 0).sum()) == flat.size  # every other row is padding
    assert src.shape[0] <= 2.5 * flat.size + PAD_FREE_ROWS * covered.size  # groups of <= 32 rows pad freely


def test_the_plan_mirrors_the_kernels_constants():
    """hybrid.plan.placement sizes the MoE buffers with copies of kernels_gpu's constants (it imports no kernels)."""
    from hybrid.plan import placement
    from kernels_gpu import matmul, moe

    assert placement.MOE_PAD_FREE_ROWS == moe.PAD_FREE_ROWS
    assert placement.MATVEC_MAX_TOKENS == matmul.MATVEC_MAX_TOKENS
    assert placement.GEMM_CHUNK_ELEMENTS == matmul.GEMM_CHUNK_ELEMENTS
    for shapes in (((768, 2048), (768, 2048), (2048, 768)), ((64, 256),) * 3, ((2880, 2880),) * 3):
        assert placement.moe_max_run(shapes) == moe.max_run(shapes)  # the experts in one upload slot's run


def test_buckets_round_up_by_at_most_a_quarter():
    sizes = [_bucket(m) for m in range(1, 4097)]
    assert all(b >= m and (b <= 32 if m <= 32 else b <= 1.25 * m) for m, b in zip(range(1, 4097), sizes))
    assert len(set(sizes)) <= 4 + 4 * 7  # 8..32, then four a power of two up to 4096

