"""Fewer launches a decode step of several rows, each the same bytes as the launches it replaces: quantize_q8_mma
(quantize_q8_1 and q8_mma_pack in one), rope_qk (rope of q and of k in one), matmul_many's one packing for every
tensor-core weight of 2-8 rows and one launch for its Q4_K weights, and GpuBackend's 8-bit copies of norms and
attention outputs for several rows.

Every test needs a CUDA device through CuPy (marked `gpu`, skipped elsewhere by conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import kernels_gpu.matmul as km  # noqa: E402
from kernels_gpu import ops  # noqa: E402
from kernels_gpu.matmul import (_q8_mma_pack, matmul, matmul_many, matvec_q8t, q8t_config, quantize_q8_1,  # noqa: E402
                                quantize_q8_mma)
from test_kernels_gpu import NMSE_MATVEC_Q8, nmse, random_weight, ref_matmul  # noqa: E402

pytestmark = pytest.mark.gpu


def _packed_bytes(pq, pm, n_tok: int, n: int, t: int):
    """The tokens' part of a packing (the columns past n_tok are never written)."""
    nb = n // 32
    return (pq.reshape(nb, t, 32)[:, :n_tok].get(), pm.reshape(nb, t, 2)[:, :n_tok].get())


@pytest.mark.parametrize("n_tok,n,groups", [(1, 4096, 1), (2, 4096, 1), (5, 1024, 1), (8, 14336, 1), (12, 512, 2)])
def test_quantize_q8_mma_is_quantize_then_pack(n_tok, n, groups):
    rng = np.random.default_rng(n_tok * n)
    x = (rng.standard_normal((n_tok, n)) * 5).astype(np.float32)
    x[0, 32:64] = 0  # an all-zero block (q = 0, d = 0)
    x[-1, 96:128] = -3.0  # a constant block
    xd = cupy.asarray(x)
    want = _packed_bytes(*_q8_mma_pack(*quantize_q8_1(xd), groups), n_tok, n, 8 * groups)
    got = _packed_bytes(*quantize_q8_mma(xd, groups), n_tok, n, 8 * groups)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="column groups"):
        quantize_q8_mma(cupy.zeros((9, 64), cupy.float32))


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("hd,n_rot,n_head,n_head_kv", [(128, 128, 32, 8), (128, 64, 8, 8), (64, 64, 3, 1)])
def test_rope_qk_is_two_ropes(mode, hd, n_rot, n_head, n_head_kv):
    rng = np.random.default_rng(hd + n_head)
    n_tok = 6
    q = rng.standard_normal((n_tok, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_tok, n_head_kv, hd)).astype(np.float32)
    pos = cupy.asarray(np.array([0, 1, 300, 4095, 9000, 32767], dtype=np.int32))
    gq, gk = ops.rope_qk(cupy.asarray(q), cupy.asarray(k), pos, n_rot, 5e5, 1.0, mode)
    np.testing.assert_array_equal(gq.get(), ops.rope(cupy.asarray(q), pos, n_rot, 5e5, 1.0, mode).get())
    np.testing.assert_array_equal(gk.get(), ops.rope(cupy.asarray(k), pos, n_rot, 5e5, 1.0, mode).get())
    assert not np.array_equal(gq.get(), q)  # it rotated something


# q/k/v of Llama-8B's shape (v Q6_K, or Q4_K as in half of a Q4_K_M file's layers), gate/up
SETS = [(("Q4_K", "Q4_K", "Q6_K"), (4096, 1024, 1024), 4096), (("Q4_K", "Q4_K", "Q4_K"), (4096, 1024, 1024), 4096),
        (("Q4_K", "Q4_K"), (14336, 14336), 4096)]


@pytest.mark.parametrize("case", range(len(SETS)))
@pytest.mark.parametrize("n_tok", [2, 4, 5, 8])
@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("multi", [True, False])
def test_matmul_many_packs_once_and_matches_each_product(case, n_tok, given, multi, monkeypatch):
    """matmul_many of 2-8 rows (one quantization, one packing) gives, bit for bit, what each weight's own matvec_q8t
    gives on quantize_q8_1's activations (the route before the shared packing), with and without q8_act. With
    MMQ_MULTI, where a Q4_K weight takes the tensor cores every Q4_K weight shares its launch (matvec_mmq_q4_k_m),
    the smaller ones too: each then equals its own tensor-core product (matvec_q8t's kernel "mma")."""
    monkeypatch.setattr(km, "MMQ_MULTI", multi)
    types, n_outs, n_in = SETS[case]
    rng = np.random.default_rng(17 * n_tok + case)
    raws = [cupy.asarray(random_weight(t, n, n_in, rng)) for t, n in zip(types, n_outs)]
    x = cupy.asarray(rng.standard_normal((n_tok, n_in)).astype(np.float32))
    xq, xm = quantize_q8_1(x)
    ys = matmul_many(raws, list(types), x, q8_act=(xq, xm) if given else None)
    kernels = [q8t_config(t, n, n_tok)[0] for t, n in zip(types, n_outs)]
    lead = any(k == "mma" and t == "Q4_K" for k, t in zip(kernels, types))
    shared = multi and lead and types.count("Q4_K") >= 2
    for y, raw, t, n, kern in zip(ys, raws, types, n_outs, kernels):
        rides = shared and t == "Q4_K" and kern != "mma"
        want = cupy.empty((n_tok, n), dtype=cupy.float32)
        matvec_q8t(raw, t, xq, xm, want, kernel="mma" if rides else None)
        np.testing.assert_array_equal(y.get(), want.get())
        if not rides:
            alone = matmul(raw, t, x)  # its own quantization (with the packing where it takes the tensor cores)
            np.testing.assert_array_equal(alone.get(), want.get())
        ref = ref_matmul(raw.get(), t, x.get())
        assert nmse(y.get(), ref) < NMSE_MATVEC_Q8
    if n_tok >= 5:
        assert "mma" in kernels  # the shared packing was exercised
    if shared and case < 2:
        assert kernels[1] == "dp4a"  # k rode in q's tensor-core launch


def test_backend_norm_and_attention_give_eight_rows_their_8bit_copy(monkeypatch):
    """GpuBackend: rms_norm / add_rms_norm of up to Q8_MEMO_ROWS rows leave their quantize_q8_1 bytes in the memo
    that matmul reads (so no quantization runs there), and the products equal those on a fresh quantization."""
    from hybrid.backends.gpu import Q8_MEMO_ROWS, GpuBackend
    from hybrid.model.weights import Weight

    be = GpuBackend()
    rng = np.random.default_rng(3)
    n = 4096
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    raw = random_weight("Q4_K", 4096, n, rng)
    weight = be.upload(Weight("blk.0.attn_q.weight", "Q4_K", (4096, n), raw))
    for rows in (2, 8, 40):
        x = cupy.asarray(rng.standard_normal((rows, n)).astype(np.float32))
        a = cupy.asarray(rng.standard_normal((rows, n)).astype(np.float32))
        out = be.rms_norm(x, w, 1e-6)
        memo = be._q8_of(out)
        assert memo is not None and rows <= Q8_MEMO_ROWS
        xq, xm = quantize_q8_1(out)
        np.testing.assert_array_equal(memo[0].get(), xq.get())
        np.testing.assert_array_equal(memo[1].get(), xm.get())
        calls = []
        for name in ("quantize_q8_1", "quantize_q8_mma"):
            real = getattr(km, name)
            monkeypatch.setattr(km, name, lambda *args, real=real: calls.append(1) or real(*args))
        got = be.matmul(weight, out)
        monkeypatch.undo()
        assert not calls  # the norm's copy served
        np.testing.assert_array_equal(got.get(), matmul(weight.raw, "Q4_K", out, q8_act=(xq, xm)).get())
        total, normed = be.add_rms_norm(x, a, w, 1e-6)
        memo = be._q8_of(normed)
        assert memo is not None
        np.testing.assert_array_equal(memo[0].get(), quantize_q8_1(normed)[0].get())


def test_argmax_rows_is_numpys_argmax():
    """ops.argmax_rows (a decode step's greedy ids, computed on the GPU): np.argmax's choice, ties to the lowest
    index, over rows of a vocabulary's width and odd ones."""
    rng = np.random.default_rng(11)
    for n in (128256, 1000, 33):
        x = rng.standard_normal((9, n)).astype(np.float32)
        x[1, [5, n // 2, n - 1]] = 50.0  # a tie: the lowest index wins
        x[2, :] = -np.inf
        x[2, n - 1] = -1e30  # the only finite value, last
        x[3, :] = 7.0  # all equal: 0
        x[4, n - 1] = 99.0  # the last index
        got = ops.argmax_rows(cupy.asarray(x)).get()
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.astype(np.int64), np.argmax(x, axis=1))
