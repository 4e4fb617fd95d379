"""The second-round MoE architectures' pieces (glm4moe, deepseek2): the routing of hybrid.model.arch.moe against a
plain per-token reference of llama.cpp's build_moe_ffn, the fused MoE forms stepping aside for it, NextN blocks
left unloaded, and MLA's KV cache (one [latent | rope key] row per token) as big as the plan counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gguf_io import ModelConfig, open_gguf
from gguf_factory import tiny_model, write_gguf
from hybrid.backends.cpu import CpuBackend
from hybrid.kv.cache import KVCache
from hybrid.model.arch import arch_spec
from hybrid.model.arch.moe import Routing, fused_moe_ok, route_gated, routing
from hybrid.model.weights import load_weights
from hybrid.plan.placement import kv_bytes_per_cell

ARCH_DIR = Path(__file__).resolve().parent / "fixtures" / "arch"


def _reference(logits: np.ndarray, r: Routing, bias) -> tuple[list, list]:
    """build_moe_ffn for one token at a time, in float64: probs, biased selection, groups, top-k, weights."""
    ids_all, w_all = [], []
    for z in logits.astype(np.float64):
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum() if r.gating == "softmax" else 1 / (1 + np.exp(-z))
        sel = p + (0 if bias is None else bias)
        if r.n_groups > 1:
            g = sel.reshape(r.n_groups, -1)
            score = np.sort(g, axis=1)[:, -2:].sum(axis=1)
            best = sorted(range(r.n_groups), key=lambda i: -score[i])[:r.n_group_used]
            sel = np.where(np.isin(np.arange(len(sel)) // g.shape[1], best), sel, -np.inf)
        ids = sorted(range(len(sel)), key=lambda e: -sel[e])[:r.n_used]
        w = p[ids] / (p[ids].sum() if r.normalize else 1.0) * r.scale
        ids_all.append(ids)
        w_all.append(w)
    return ids_all, w_all


@pytest.mark.parametrize("gating,bias,groups,scale", [("sigmoid", True, (0, 0), 2.5), ("sigmoid", True, (4, 2), 2.5),
                                                      ("softmax", True, (8, 3), 1.0), ("sigmoid", False, (0, 0), 1.0)])
def test_route_gated_matches_build_moe_ffn(gating, bias, groups, scale):
    rng = np.random.default_rng(7)
    n_expert = 64
    logits = (rng.standard_normal((300, n_expert)) * 2).astype(np.float32)
    b = (rng.standard_normal(n_expert) * 0.5).astype(np.float32) if bias else None
    r = Routing(6, gating, True, scale, *groups)
    ids, w = route_gated(logits, r, b)
    ref_ids, ref_w = _reference(logits, r, b)
    same = [t for t in range(len(logits)) if list(ids[t]) == ref_ids[t]]
    assert len(same) >= 298, len(same)  # float32 vs float64 may part at a near tie
    np.testing.assert_allclose(w[same], np.array(ref_w)[same], rtol=1e-5)
    assert w.dtype == np.float32 and ids.dtype == np.int64


def test_bias_selects_but_does_not_weigh():
    logits = np.array([[0.0, 0.1, 0.2, 0.3]], np.float32)
    bias = np.array([5.0, 0.0, 0.0, 0.0], np.float32)  # expert 0 is picked for its bias alone
    ids, w = route_gated(logits, Routing(2, "sigmoid", False, 1.0, 0, 0), bias)
    assert ids[0].tolist() == [0, 3]
    np.testing.assert_allclose(w[0], 1 / (1 + np.exp(-np.array([0.0, 0.3]))), rtol=1e-6)


def test_group_limit_keeps_the_best_group():
    # group 0 = experts 0-3 scores 0.9 + 0.1; group 1 = experts 4-7 scores 0.8 + 0.7: group 1 wins, so expert 0
    # (the single best score) is out
    sel = np.array([[0.9, 0.1, 0.0, 0.0, 0.8, 0.7, 0.0, 0.0]], np.float32)
    logits = np.log(sel / (1 - sel + 1e-12) + 1e-12).astype(np.float32)  # sigmoid(logits) ~ sel
    ids, _ = route_gated(logits, Routing(2, "sigmoid", True, 1.0, 2, 1), None)
    assert ids[0].tolist() == [4, 5]


@pytest.mark.parametrize("name", ["glm4moe-q4_k_m", "deepseek2-q4_k_m"])
def test_gated_routing_is_not_the_cpus_compiled_form(name):
    """The CPU's compiled routing is plain softmax only (fused_moe_ok): the CPU routes the gated forms on the host
    (tests/test_cpu_moe.py holds it to the op-by-op path) and its one-call decode form steps aside."""
    from hybrid.backends.cpu_moe import FusedMoE  # noqa: PLC0415

    with open_gguf(ARCH_DIR / f"{name}.gguf") as f:
        cfg = ModelConfig.from_gguf(f)
        spec = arch_spec(cfg.arch)
        lw = load_weights(f, cfg).layers[1]
        assert not routing(spec, cfg).plain and not fused_moe_ok(spec, cfg, lw)
        h = np.ones((2, cfg.n_embd), np.float32)
        assert FusedMoE().ffn_half(spec, cfg, lw, h, h) is None


def test_nextn_blocks_are_not_loaded(tmp_path):
    md, ts = tiny_model("llama", n_layer=3, extra={"llama.nextn_predict_layers": 1})
    with open_gguf(write_gguf(tmp_path / "m.gguf", md, ts)) as f:
        cfg = ModelConfig.from_gguf(f)
        w = load_weights(f, cfg)
    assert cfg.n_layer == 2 and cfg.n_layer_nextn == 1 and len(w.layers) == 2


@pytest.mark.parametrize("type_k", ["f16", "q8_0"])
def test_mla_cache_is_the_latent_and_rope_key(type_k):
    with open_gguf(ARCH_DIR / "deepseek2-f16.gguf") as f:
        cfg = ModelConfig.from_gguf(f)
    cache = KVCache.create(cfg, [CpuBackend()] * cfg.n_layer, 64, type_k, "f16")
    layer = cache.layers[0]
    assert layer.v is layer.k and layer.head_dim_k == cfg.n_lora_kv + cfg.n_rot == 96
    assert cache.nbytes == cfg.n_layer * 64 * kv_bytes_per_cell(cfg, type_k, "f16")
    # against a per-head K/V cache of the decompressed keys and values: 4 x (64 + 32) values a token in f16
    assert kv_bytes_per_cell(cfg, "f16", "f16") == 96 * 2 < cfg.n_head * (64 + 32) * 2


@pytest.mark.parametrize("name", ["glm4moe-q4_k_m", "deepseek2-q4_k_m"])
def test_engine_opens_and_lists_its_cpu_kernels(name):
    """What a first `hybrid run` does before the warm-up: open the file (aliases renamed, every layer's tensors
    checked) and list the CPU kernels to compile (MLA layers have no attn_q/k/v)."""
    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415

    engine = Engine.open(ARCH_DIR / f"{name}.gguf", EngineParams(n_ctx=64))
    try:
        assert "ffn_norm" in engine.weights.layers[0] and "post_attention_norm" not in engine.weights.layers[0]
        assert engine.cpu_kernels()
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_gpu_rope_yarn_matches_the_cpu(mode):
    """GpuBackend.rope with YaRN (kernels_gpu.rope_yarn) against the CPU's ggml-exact rope tables."""
    cp = pytest.importorskip("cupy")
    from hybrid.backends.gpu import GpuBackend  # noqa: PLC0415

    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, 4, 48)).astype(np.float32)
    pos = np.arange(100, 137, dtype=np.int32)
    yarn = (1.0, 0.7305200099945068, 5.0, 12.0)  # deepseek2-f16's
    ref = CpuBackend().rope(x.copy(), pos, 32, 10000.0, 1 / 40, mode, yarn)
    got = cp.asnumpy(GpuBackend().rope(cp.asarray(x), pos, 32, 10000.0, 1 / 40, mode, yarn))
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    assert np.array_equal(got[:, :, 32:], x[:, :, 32:])


@pytest.mark.parametrize("name", ["deepseek2-q4_k_m", "glm4moe-q4_k_m"])
def test_cpu_decode_steps_match_the_prefill(name):
    """A token decoded alone (the CPU's few-token paths: fused where the layer allows, MLA op by op) gives the
    logits the prefill gives it (the leading dense layer of deepseek2 has no attn_q: no fused attention for it)."""
    import numpy as np

    from hybrid.engine import Engine, EngineParams

    eng = Engine.load(ARCH_DIR / f"{name}.gguf", EngineParams(n_ctx=128))
    try:
        full = eng.eval(list(range(5, 40)), eng.new_cache(), logits_from=0)
        cache = eng.new_cache()
        eng.eval(list(range(5, 39)), cache)
        step = eng.eval([39], cache)
    finally:
        eng.close()
    assert np.argmax(step) == np.argmax(full[-1]) and np.abs(step - full[-1]).max() < 0.05
