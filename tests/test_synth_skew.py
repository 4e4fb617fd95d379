"""make_model's skewed router (ModelShape.router_skew, scripts/make_model.py --router-skew): the experts' share of
the routed tokens is Zipf-like and differs per layer, where the default router spreads them evenly."""

from __future__ import annotations

import numpy as np
import pytest

import hybrid.model.arch.blocks as blocks
from hybrid.backends.cpu import CpuBackend
from hybrid.engine import Engine, EngineParams
from hybrid.tools.synth.model import ModelShape, make_model, router_row_scales

SHAPE = ModelShape(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024, n_expert=32,
                   n_expert_used=4, n_ff_exp=64)


def _counts(path, monkeypatch) -> np.ndarray:
    """(n_layer, n_expert) tokens routed to each expert over a 256-token batch (op-by-op routing recorded)."""
    monkeypatch.setattr(CpuBackend, "fused_moe", lambda *args: None)
    ffn = CpuBackend.fused_ffn
    monkeypatch.setattr(CpuBackend, "fused_ffn", lambda be, spec, *args: None if spec.moe else ffn(be, spec, *args))
    seen: list[np.ndarray] = []
    orig = blocks.route

    def rec(logits, n_used, normalize):
        ids, w = orig(logits, n_used, normalize)
        seen.append(ids)
        return ids, w

    monkeypatch.setattr(blocks, "route", rec)
    eng = Engine.load(path, EngineParams(n_ctx=256, n_batch=256, n_ubatch=256))
    try:
        eng.eval(np.random.default_rng(1).integers(3, SHAPE.n_vocab, 256), eng.new_cache())
    finally:
        eng.close()
    assert len(seen) == SHAPE.n_layer
    return np.stack([np.bincount(ids.reshape(-1), minlength=SHAPE.n_expert) for ids in seen])


def _top_share(counts: np.ndarray, top: int = 4) -> np.ndarray:
    return np.sort(counts, axis=1)[:, -top:].sum(axis=1) / counts.sum(axis=1)


def test_row_scales_are_zipf_like_and_differ_per_layer():
    a, b = np.array(router_row_scales(32, 1.0, 0)), np.array(router_row_scales(32, 1.0, 1))
    assert np.isclose(np.mean(a ** 2), 1.0) and sorted(a) == sorted(b) and not np.array_equal(a, b)
    s = np.sort(a)[::-1]
    assert np.allclose(s[0] / s[1:4], [2, 3, 4])  # (1 + rank)^-1


@pytest.mark.parametrize("qtype", ["Q4_K_M"])
def test_a_skewed_router_concentrates_the_tokens(tmp_path, monkeypatch, qtype):
    even, skewed = tmp_path / "even.gguf", tmp_path / "skew.gguf"
    make_model(even, "qwen3moe", SHAPE, qtype, seed=3, threads=2)
    make_model(skewed, "qwen3moe", SHAPE, qtype, seed=3, threads=2, router_skew=1.0)
    with monkeypatch.context() as m:
        c_even = _counts(even, m)
    with monkeypatch.context() as m:
        c_skew = _counts(skewed, m)
    share_even, share_skew = _top_share(c_even), _top_share(c_skew)
    # the 4 busiest of 32 experts: a random router already favours some (measured 0.29, 0.41, 0.48 of the slots in
    # layers 0-2, the later layers' inputs being less random); the skewed one gives them more in every layer
    # (measured 0.41, 0.52, 0.59)
    assert (share_skew > share_even + 0.05).all(), (share_even, share_skew)
    widest = [np.argsort(-np.array(router_row_scales(32, 1.0, il)))[:4] for il in range(SHAPE.n_layer)]
    assert len({frozenset(w.tolist()) for w in widest}) == SHAPE.n_layer  # other hot experts in every layer
    for il in range(SHAPE.n_layer):  # the layer's 4 widest router rows take 2x their share without the skew
        mine = c_skew[il, widest[il]].sum() / c_skew[il].sum()
        before = c_even[il, widest[il]].sum() / c_even[il].sum()
        assert mine > 2 * before and mine > 0.3, (il, mine, before)  # (measured 0.38 vs 0.13, 0.49 vs 0.19, ...)
