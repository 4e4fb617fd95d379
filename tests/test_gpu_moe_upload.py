"""kernels_gpu.moe_upload.prefill_uploaded: experts in host memory, the used ones copied into compact slots a
chunk at a time and run on the tensor cores, give the very rows of moe.prefill_mma on the same experts resident on
the device (the same kernels, each row's sums in the same order), for several chunks a batch, with bias rows
(gpt-oss) and without; the bytes copied are the used experts' alone."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from kernels_gpu import moe, moe_upload  # noqa: E402
from kernels_gpu.transfer import CopyRing  # noqa: E402
from test_gpu_moe import _experts  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gate_t,down_t,n_embd,n_ff,act,bias", [
    ("Q4_K", "Q6_K", 512, 256, "silu", False),
    ("Q4_0", "Q8_0", 320, 96, "silu", False),
    ("MXFP4", "MXFP4", 320, 160, "swiglu_oai", True),
])
@pytest.mark.parametrize("n_tok,capacity", [(200, 2), (40, 16)])
def test_uploaded_experts_give_the_resident_rows(gate_t, down_t, n_embd, n_ff, act, bias, n_tok, capacity):
    rng = np.random.default_rng(n_tok + n_ff)
    n_expert, k = 16, 3
    gate, up = (_experts(gate_t, n_expert, n_ff, n_embd, rng, 0.05) for _ in range(2))
    down = _experts(down_t, n_expert, n_embd, n_ff, rng, 0.05)
    scores = rng.random((n_tok, n_expert))
    scores[:, 0] += 1.0  # every token picks expert 0 (several tiles)
    scores[:, 9:12] -= 1.0  # none picks 9, 10, 11 (runs are cut around them)
    ids = cupy.asarray(np.argsort(-scores, axis=1)[:, :k].astype(np.int32))
    w = cupy.asarray(rng.random((n_tok, k)).astype(np.float32))
    h = cupy.asarray(rng.standard_normal((n_tok, n_embd)).astype(np.float32))
    biases = tuple(cupy.asarray(rng.standard_normal((n_expert, n)).astype(np.float32) * 0.1) if bias else None
                   for n in (n_ff, n_ff, n_embd))
    experts = ((gate, gate_t), (up, gate_t), (down, down_t))
    per = max(moe_upload.expert_bytes(a) for a, _ in experts)
    ring = CopyRing(capacity * per, 6)
    assert moe_upload.why_not(experts, ring.slot_bytes) == ""
    got, copied = moe_upload.prefill_uploaded(h, ids, w, experts, act, ring, biases)
    dev = [cupy.asarray(a) for a in (gate, up, down)]
    ref = moe.prefill_mma(h, ids, w, (dev[0], gate_t), (dev[1], gate_t), (dev[2], down_t), act, biases)
    assert np.array_equal(got.get(), ref.get())
    used = np.unique(ids.get())
    assert copied == used.size * sum(moe_upload.expert_bytes(a) for a, _ in experts)
    assert ring.copied_bytes == copied
    # the ring is whole again: a second batch through it gives the same rows
    again, _ = moe_upload.prefill_uploaded(h, ids, w, experts, act, ring, biases)
    assert np.array_equal(again.get(), got.get())


@pytest.mark.parametrize("gate_t,down_t,n_embd,n_ff", [("Q4_K", "Q6_K", 512, 256), ("Q4_0", "Q8_0", 320, 96)])
def test_experts_in_a_cache_are_read_from_their_slots(gate_t, down_t, n_embd, n_ff):
    """An expert cache's slots stand in for those experts' uploads: the same rows, and only the others copied."""
    rng = np.random.default_rng(n_ff)
    n_expert, k, n_tok, n_slots = 16, 3, 120, 4
    gate, up = (_experts(gate_t, n_expert, n_ff, n_embd, rng, 0.05) for _ in range(2))
    down = _experts(down_t, n_expert, n_embd, n_ff, rng, 0.05)
    scores = rng.random((n_tok, n_expert))
    scores[:, 0] += 1.0
    scores[:, 9:12] -= 1.0
    ids = cupy.asarray(np.argsort(-scores, axis=1)[:, :k].astype(np.int32))
    w = cupy.asarray(rng.random((n_tok, k)).astype(np.float32))
    h = cupy.asarray(rng.standard_normal((n_tok, n_embd)).astype(np.float32))
    experts = ((gate, gate_t), (up, gate_t), (down, down_t))
    table = np.full(n_expert, -1, dtype=np.int32)
    table[[0, 5, 10]] = [2, 0, 1]  # 10 is used by no token; slot 3 is free, slot 4 the zero slot
    pools = []
    for raw in (gate, up, down):
        pool = np.zeros((n_slots + 1,) + raw.shape[1:], dtype=raw.dtype)
        for e in np.flatnonzero(table >= 0):
            pool[table[e]] = raw[e]
        pools.append(cupy.asarray(pool))
    per = max(moe_upload.expert_bytes(a) for a, _ in experts)
    ring = CopyRing(2 * per, 6)
    got, copied = moe_upload.prefill_uploaded(h, ids, w, experts, "silu", ring,
                                              cached=(cupy.asarray(table), tuple(pools)))
    dev = [cupy.asarray(a) for a in (gate, up, down)]
    ref = moe.prefill_mma(h, ids, w, (dev[0], gate_t), (dev[1], gate_t), (dev[2], down_t), "silu")
    assert np.array_equal(got.get(), ref.get())
    used = np.unique(ids.get())
    uploaded = [e for e in used.tolist() if table[e] < 0]
    assert 0 in used and len(uploaded) == used.size - 1 - int(5 in used)
    assert copied == len(uploaded) * sum(moe_upload.expert_bytes(a) for a, _ in experts)
    # every used expert cached: nothing copied
    ids2 = cupy.asarray(np.array([[0, 5, 10], [10, 0, 5], [5, 10, 0]] * 30, dtype=np.int32))
    got, copied = moe_upload.prefill_uploaded(h[:90], ids2, w[:90], experts, "silu", ring,
                                              cached=(cupy.asarray(table), tuple(pools)))
    ref = moe.prefill_mma(h[:90], ids2, w[:90], (dev[0], gate_t), (dev[1], gate_t), (dev[2], down_t), "silu")
    assert copied == 0 and np.array_equal(got.get(), ref.get())


def test_why_not():
    rng = np.random.default_rng(3)
    q4 = _experts("Q4_K", 4, 64, 256, rng, 0.05)
    q8 = _experts("Q8_0", 4, 64, 256, rng, 0.05)
    down = _experts("Q6_K", 4, 256, 64 * 4, rng, 0.05)
    ok = ((q4, "Q4_K"), (q4, "Q4_K"), (down, "Q6_K"))
    assert moe_upload.why_not(ok, 1 << 20) == ""
    assert "differ" in moe_upload.why_not(((q4, "Q4_K"), (q8, "Q8_0"), (down, "Q6_K")), 1 << 20)
    assert "exceeds" in moe_upload.why_not(ok, 1000)
