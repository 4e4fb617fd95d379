"""The repack of GPU layers' experts in RAM (backends/repack.py repack_host_experts): only the layouts that move
bytes (byte_permutation), and their exact inverse (unrepack, the reference of kernels_gpu.unrepack)."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.backends.host_experts import EXPERT_TENSORS, file_type
from hybrid.backends.repack import LAYOUTS, byte_permutation, repack_host_experts, unrepack
from hybrid.model.weights import Weight

TYPE_SIZE = {"Q4_0": 18, "MXFP4": 17}


def test_permuting_layouts_are_found_by_probing_the_cpu_repack():
    assert {t for t in LAYOUTS if byte_permutation(t) is not None} == {"Q4_0", "MXFP4"}
    for t, ts in TYPE_SIZE.items():
        perm = byte_permutation(t)
        assert perm.shape == (8 * ts,) and sorted(perm.tolist()) == list(range(8 * ts))
    assert byte_permutation("F16") is None


@pytest.mark.parametrize("type_name", sorted(TYPE_SIZE))
@pytest.mark.parametrize("rows,blocks", [(8, 1), (16, 3), (64, 90), (768, 8)])
def test_unrepack_inverts_the_repack(type_name, rows, blocks):
    rng = np.random.default_rng(rows * blocks)
    raw = rng.integers(0, 256, (rows, blocks * TYPE_SIZE[type_name]), dtype=np.uint8)
    packed = LAYOUTS[type_name][2](raw)
    assert not np.array_equal(packed, raw)
    assert np.array_equal(unrepack(packed, type_name), raw)


def test_expert_stacks_unrepack_as_one_matrix():
    """A run of experts uploaded together is (experts x rows) rows: groups never straddle two experts."""
    rng = np.random.default_rng(5)
    n_exp, rows, rb = 5, 24, 4 * 17
    raw = rng.integers(0, 256, (n_exp, rows, rb), dtype=np.uint8)
    lw = {n: Weight(f"blk.0.{n}.weight", "MXFP4", (n_exp, rows, rb // 17 * 32), raw.copy()) for n in EXPERT_TENSORS}
    lw["ffn_down_exps"] = Weight("blk.0.ffn_down_exps.weight", "Q4_K", (n_exp, 8, 256), np.zeros((n_exp, 8, 144),
                                                                                               np.uint8))
    done = repack_host_experts([lw], EXPERT_TENSORS)
    assert done.n_matrices == 2 and done.types == ("MXFP4",)
    assert lw["ffn_gate_exps"].type_name == "MXFP4_X8" and lw["ffn_down_exps"].type_name == "Q4_K"
    packed = lw["ffn_up_exps"].raw
    assert packed.shape == raw.shape
    assert np.array_equal(unrepack(packed[1:4].reshape(-1, rb), "MXFP4"), raw[1:4].reshape(-1, rb))
    assert file_type("MXFP4_X8") == "MXFP4" and file_type("Q4_0_X8") == "Q4_0"
    assert file_type("Q4_K_X8") == "Q4_K_X8" and file_type("Q6_K") == "Q6_K"  # no permutation: not uploaded as one
