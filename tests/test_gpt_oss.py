"""gpt-oss's pieces against float64 references: the clamped SwiGLU (swiglu_oai), attention sinks in the CPU attention
kernel, the routing (top k of the raw router logits, softmax of the k selected) with the router's and the experts'
biases in blocks.moe_ffn, the fused forms stepping aside, the config's sliding-window pattern, and decode against
prefill on the gpt-oss fixture (tests/fixtures/arch)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import kernels_cpu.attention as attention_module
from gguf_io import ModelConfig, open_gguf
from gguf_io.config import _Keys
from gguf_io.config_moe import gpt_oss_swa
from gguf_io.errors import GGUFFormatError
from kernels_cpu.activations import swiglu_oai
from kernels_cpu.attention import attention
from kernels_cpu.kv_cache import alloc_kv_layer, kv_read, kv_store
from hybrid.backends.cpu import CpuBackend
from hybrid.model.arch import adopt_layers, arch_spec
from hybrid.model.arch.blocks import moe_ffn, rope_params
from hybrid.model.arch.moe import Routing, fused_moe_ok, route_gated, routing
from hybrid.model.weights import Weight, load_weights

ARCH_DIR = Path(__file__).resolve().parent / "fixtures" / "arch"
NMSE_EXACT = 1e-10  # attention vs float64 over the values the cache holds (as tests/test_kernels_cpu_attention.py)


def nmse(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def swiglu_oai_f64(g, u, alpha=1.702, limit=7.0):
    x = np.minimum(np.asarray(g, np.float64), limit)
    y = np.clip(np.asarray(u, np.float64), -limit, limit)
    return x / (1 + np.exp(-alpha * x)) * (y + 1)


# ---------------------------------------------------------------- swiglu_oai

def test_swiglu_oai_matches_float64():
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((5, 301)) * 6).astype(np.float32)
    u = (rng.standard_normal((5, 301)) * 6).astype(np.float32)
    g[0, :8] = [-200.0, -7.5, -1e-3, 0.0, 6.99, 7.0, 7.01, 60.0]  # exp overflow, both sides of the clamp
    u[0, :8] = [-60.0, -7.01, -7.0, 0.0, 1.0, 7.0, 7.01, 60.0]
    out = swiglu_oai(g, u)
    assert out.dtype == np.float32 and out.shape == g.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out, swiglu_oai_f64(g, u), rtol=1e-5, atol=1e-6)
    assert np.array_equal(CpuBackend().glu(g, u, "swiglu_oai"), out)
    # the clamps bite: a gate above 7 counts as 7 (no lower clamp), an up beyond +-7 as +-7
    one = np.ones(1, np.float32)
    assert swiglu_oai(one * 50, one) == swiglu_oai(one * 7, one)
    assert swiglu_oai(one * 2, one * 50) == swiglu_oai(one * 2, one * 7)
    assert swiglu_oai(one * -30, one) != swiglu_oai(one * -7, one)
    assert not np.allclose(out, swiglu_oai_f64(g, u, limit=1e9), rtol=1e-3)  # the unclamped form differs


# ---------------------------------------------------------------- attention sinks

def ref_attention_sinks(q, k, v, positions, scale, sinks, n_swa=0):
    """float64: head h's weights exp(s) / (sum over visible keys exp(s') + exp(sinks[h])); no value for the sink."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    n_tok, n_head, _ = q.shape
    group = n_head // k.shape[1]
    kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out = np.zeros((n_tok, n_head, v.shape[2]))
    keys = np.arange(k.shape[0])
    for t, p in enumerate(positions):
        visible = (keys <= p) & ((p - keys < n_swa) if n_swa > 0 else True)
        s = np.einsum("hd,khd->hk", q[t], kh[visible]) * scale  # (n_head, n_visible)
        z = np.concatenate([s, np.asarray(sinks, np.float64)[:, None]], axis=1)
        w = np.exp(z - z.max(axis=1, keepdims=True))
        w = w[:, :-1] / w.sum(axis=1, keepdims=True)
        out[t] = np.einsum("hk,khd->hd", w, vh[visible])
    return out


def _sink_case(kv_type, n_head, n_head_kv, n_tok, p0, seed):
    rng = np.random.default_rng(seed)
    n_kv, d = p0 + n_tok, 64
    layer = alloc_kv_layer(n_kv + 2, n_head_kv, d, d, kv_type, kv_type)
    k = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, d)).astype(np.float32)
    kv_store(layer, np.arange(n_kv), k, v)
    q = (rng.standard_normal((n_tok, n_head, d)) * 2).astype(np.float32)
    # per head: below, near and far above the scores (the sink then holds the running max)
    sinks = np.resize(np.array([-3.0, 0.5, 2.5, 40.0], np.float32), n_head) + np.arange(n_head, dtype=np.float32) * 0.1
    return layer, q, np.arange(p0, n_kv, dtype=np.int32), sinks


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("n_head,n_head_kv,n_tok,p0,n_swa", [(4, 1, 1, 40, 0), (4, 1, 7, 30, 32), (8, 2, 40, 0, 32),
                                                              (6, 3, 3, 5, 0), (4, 4, 1, 0, 0)])
def test_attention_sinks_match_float64(kv_type, n_head, n_head_kv, n_tok, p0, n_swa):
    layer, q, pos, sinks = _sink_case(kv_type, n_head, n_head_kv, n_tok, p0, seed=n_head + n_tok + p0)
    out = attention(q, layer, pos, 0.125, n_swa=n_swa, sinks=sinks)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    kd, vd = kv_read(layer, 0, p0 + n_tok)
    ref = ref_attention_sinks(q, kd, vd, pos, 0.125, sinks, n_swa)
    assert nmse(out, ref) < NMSE_EXACT
    no_sinks = attention(q, layer, pos, 0.125, n_swa=n_swa)
    assert nmse(no_sinks, ref) > 1e-3  # the sinks matter here (the test can fail)
    # a sink far below every score changes nothing; sinks=None is the plain kernel, bit for bit
    low = attention(q, layer, pos, 0.125, n_swa=n_swa, sinks=np.full(n_head, -1e4, np.float32))
    np.testing.assert_allclose(low, no_sinks, rtol=1e-6, atol=1e-7)
    assert np.array_equal(attention(q, layer, pos, 0.125, n_swa=n_swa, sinks=None), no_sinks)


@pytest.mark.parametrize("hpi", [1, 2, 4])
def test_attention_sinks_follow_the_query_head(monkeypatch, hpi):
    # a work item holds hpi query heads of a GQA group: each must take its own head's sink
    layer, q, pos, sinks = _sink_case("f16", 8, 2, 3, 9, seed=3)
    ref = attention(q, layer, pos, 0.125, sinks=sinks)
    monkeypatch.setattr(attention_module, "_heads_per_item", lambda *args: hpi)
    np.testing.assert_allclose(attention(q, layer, pos, 0.125, sinks=sinks), ref, rtol=1e-6, atol=1e-7)


def test_attention_sinks_checks():
    layer, q, pos, _ = _sink_case("f16", 4, 1, 1, 0, seed=1)
    with pytest.raises(ValueError, match="sinks must be 4"):
        attention(q, layer, pos, 0.125, sinks=np.zeros(3, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_gpu_attention_sinks_match_float64(kv_type):
    """kernels_gpu.attention with sinks: one query over many splits (attn_combine), the flash-decoding kernel, the
    tiled prefill kernel and a dynamic (graph) launch, with windows, against the float64 reference."""
    cp = pytest.importorskip("cupy")
    from kernels_gpu.attention import attention as gpu_attention  # noqa: PLC0415
    from kernels_gpu.kv_cache import alloc_kv_layer as gpu_alloc, kv_store as gpu_store  # noqa: PLC0415

    rng = np.random.default_rng(2)
    n_ctx, n_head, n_head_kv, d = 400, 8, 2, 64
    layer = gpu_alloc(n_ctx, n_head_kv, d, d, kv_type, kv_type)
    k = rng.standard_normal((n_ctx, n_head_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_head_kv, d)).astype(np.float32)
    gpu_store(layer, cp.arange(n_ctx, dtype=cp.int32), cp.asarray(k), cp.asarray(v))
    cpu = alloc_kv_layer(n_ctx, n_head_kv, d, d, kv_type, kv_type)
    cpu.k[:], cpu.v[:] = layer.k.get(), layer.v.get()  # the GPU cache's rows (ggml's layout, as offload uploads)
    kd, vd = kv_read(cpu, 0, n_ctx)
    sinks = np.array([-3.0, 0.5, 2.5, 40.0, 1.0, -1.0, 3.0, 0.0], np.float32)
    for pos, n_swa, kw in ((np.array([390], np.int32), 0, {}), (np.array([390], np.int32), 32, {}),
                           (np.arange(0, 40, dtype=np.int32), 32, {"prefill": True}),
                           (np.arange(100, 140, dtype=np.int32), 0, {"prefill": False}),
                           (np.array([200], np.int32), 0, {"dynamic": True})):
        q = (rng.standard_normal((len(pos), n_head, d)) * 2).astype(np.float32)
        n_kv = n_ctx if kw.get("dynamic") else int(pos.max()) + 1
        y = gpu_attention(cp.asarray(q), layer, cp.asarray(pos), n_kv, 0.125, n_swa, sinks=cp.asarray(sinks),
                          **kw).get()
        ref = ref_attention_sinks(q, kd, vd, pos, 0.125, sinks, n_swa)
        # the tiled prefill of an f16 cache runs on the tensor cores: q and the probabilities rounded to f16
        tol = 2e-6 if kw.get("prefill") and kv_type == "f16" else 1e-9
        assert np.isfinite(y).all() and nmse(y, ref) < tol, (pos[0], len(pos), n_swa, kw, nmse(y, ref))


# ---------------------------------------------------------------- routing and the expert biases

def test_softmax_weight_routing_matches_float64():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((200, 32)) * 2).astype(np.float32)
    ids, w = route_gated(logits, Routing(4, "softmax_weight", False, 1.0, 0, 0), None)
    for t, z in enumerate(logits.astype(np.float64)):
        top = sorted(range(32), key=lambda e: -z[e])[:4]
        assert ids[t].tolist() == top
        ref = np.exp(z[top] - z[top].max())
        np.testing.assert_allclose(w[t], ref / ref.sum(), rtol=1e-6)
    # the weights are not the full softmax's probabilities of the selected (that would not sum to 1)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)


def _f32_weight(name: str, a: np.ndarray) -> Weight:
    """A float32 tensor as load_weights holds it: 1-D as float32, 2-D/3-D as raw bytes."""
    a = np.ascontiguousarray(a, np.float32)
    if a.ndim == 1:
        return Weight(name, "F32", a.shape, a)
    return Weight(name, "F32", a.shape, a.view(np.uint8))


@pytest.fixture(scope="module")
def gpt_oss_cfg() -> ModelConfig:
    with open_gguf(ARCH_DIR / "gpt-oss-mxfp4.gguf") as f:
        return ModelConfig.from_gguf(f)


def test_moe_ffn_adds_router_and_expert_biases(gpt_oss_cfg):
    rng = np.random.default_rng(11)
    n_embd, n_ff, n_expert, k = 16, 8, 8, 4
    cfg = replace(gpt_oss_cfg, n_embd=n_embd, n_expert=n_expert, n_expert_used=k, n_ff_exp=n_ff)
    spec = arch_spec("gpt-oss")
    t = {"ffn_gate_inp": rng.standard_normal((n_expert, n_embd)) * 0.3, "ffn_gate_inp.bias": rng.standard_normal(8),
         "ffn_gate_exps": rng.standard_normal((n_expert, n_ff, n_embd)) * 2,
         "ffn_up_exps": rng.standard_normal((n_expert, n_ff, n_embd)) * 2,
         "ffn_down_exps": rng.standard_normal((n_expert, n_embd, n_ff)) * 0.2,
         "ffn_gate_exps.bias": rng.standard_normal((n_expert, n_ff)),
         "ffn_up_exps.bias": rng.standard_normal((n_expert, n_ff)),
         "ffn_down_exps.bias": rng.standard_normal((n_expert, n_embd))}
    t = {name: a.astype(np.float32) for name, a in t.items()}
    lw = {name: _f32_weight(name, a) for name, a in t.items()}
    h = rng.standard_normal((9, n_embd)).astype(np.float32)

    assert not routing(spec, cfg).plain and not fused_moe_ok(spec, cfg, lw)
    out = moe_ffn(CpuBackend(), spec, cfg, lw, h)

    ref = np.zeros((9, n_embd))
    for i, x in enumerate(h.astype(np.float64)):
        logits = t["ffn_gate_inp"] @ x + t["ffn_gate_inp.bias"]
        top = np.argsort(-logits, kind="stable")[:k]
        w = np.exp(logits[top] - logits[top].max())
        for e, we in zip(top, w / w.sum()):
            g = t["ffn_gate_exps"][e] @ x + t["ffn_gate_exps.bias"][e]
            u = t["ffn_up_exps"][e] @ x + t["ffn_up_exps.bias"][e]
            ref[i] += we * (t["ffn_down_exps"][e] @ swiglu_oai_f64(g, u) + t["ffn_down_exps.bias"][e])
    assert nmse(out, ref) < 1e-9, nmse(out, ref)

    for name in ("ffn_gate_inp.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"):  # each bias is used
        without = {n: w for n, w in lw.items() if n != name}
        assert nmse(moe_ffn(CpuBackend(), spec, cfg, without, h), ref) > 1e-4, name


# ---------------------------------------------------------------- the model: config, spec, fused forms

def test_config_and_layer_parameters(gpt_oss_cfg):
    cfg = gpt_oss_cfg
    assert cfg.arch == "gpt-oss" and cfg.rope_type == "neox" and not cfg.tied_output
    assert cfg.n_swa == 32 and cfg.swa_layers == (True, False, True, False)
    assert cfg.expert_gating_func == "softmax_weight" and cfg.n_expert_used == 4 and cfg.n_ff_exp == 32
    assert cfg.yarn_corr_dims == (8.0, 18.0) and cfg.f_attention_scale == 0.125
    assert rope_params(cfg, 0) == (150000.0, 1 / 32, 32)  # the SWA layers keep the YaRN scale
    assert rope_params(cfg, 1) == (150000.0, 1 / 32, 0)


@pytest.mark.parametrize("value,expected", [(None, (True, False, True, False)), (3, (True, True, False, True)),
                                            (0, (True,) * 4), (np.array([0, 1, 1, 0], np.uint8),
                                                                (False, True, True, False))])
def test_sliding_window_pattern(value, expected):
    md = {"gpt-oss.attention.sliding_window": 128}
    if value is not None:
        md["gpt-oss.attention.sliding_window_pattern"] = value
    assert gpt_oss_swa(_Keys(md, "gpt-oss", "x.gguf"), 4) == (128, expected)


def test_layers_need_sinks_and_biases(gpt_oss_cfg):
    spec = arch_spec("gpt-oss")
    with open_gguf(ARCH_DIR / "gpt-oss-q4_k_m.gguf") as f:
        weights = load_weights(f, gpt_oss_cfg)
    adopt_layers(spec, gpt_oss_cfg, weights)
    assert "ffn_norm" in weights.layers[0] and "post_attention_norm" not in weights.layers[0]
    lw = weights.layers[2]
    for name, in_file in (("attn_sinks", "blk.2.attn_sinks.weight"), ("ffn_up_exps.bias", "blk.2.ffn_up_exps.bias")):
        held = lw.pop(name)
        with pytest.raises(GGUFFormatError, match=in_file.replace(".", r"\.")):
            adopt_layers(spec, gpt_oss_cfg, weights)
        lw[name] = held


def test_fused_forms_step_aside(gpt_oss_cfg):
    from hybrid.backends.cpu_fused import fusable  # noqa: PLC0415
    from hybrid.backends.cpu_moe import FusedMoE  # noqa: PLC0415

    spec = arch_spec("gpt-oss")
    with open_gguf(ARCH_DIR / "gpt-oss-q4_k_m.gguf") as f:
        weights = load_weights(f, gpt_oss_cfg)
    adopt_layers(spec, gpt_oss_cfg, weights)
    lw = weights.layers[1]
    h = np.ones((2, gpt_oss_cfg.n_embd), np.float32)
    assert not fusable(spec, lw, 1) and not fused_moe_ok(spec, gpt_oss_cfg, lw)  # the CPU's compiled routing: not this
    # the CPU's: routed on the host, the experts compiled with their biases (tests/test_cpu_moe.py: bit for bit);
    # the one-call decode form (compiled routing) steps aside
    out = FusedMoE()(spec, gpt_oss_cfg, lw, h)
    assert out.shape == h.shape and np.isfinite(out).all()
    assert FusedMoE().ffn_half(spec, gpt_oss_cfg, lw, h, h) is None
    # the same layer with plain routing, SwiGLU and no biases would be fused: the gate is the features, not the types
    plain = {n: w for n, w in lw.items() if not n.endswith(".bias")}
    plain_cfg = replace(gpt_oss_cfg, expert_gating_func="softmax")
    assert fused_moe_ok(replace(spec, ffn_act="silu"), plain_cfg, plain)


def test_decode_matches_prefill():
    """Token by token (the decode path: one-token batches, past the 32-token window) against one batch."""
    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from hybrid.generate.sampling import log_softmax  # noqa: PLC0415

    tokens = np.load(ARCH_DIR / "gpt-oss-mxfp4.GPL-3.npz")["tokens"][1][:44]
    engine = Engine.load(ARCH_DIR / "gpt-oss-mxfp4.gguf", EngineParams(n_ctx=64, n_batch=64, n_ubatch=64))
    try:
        full = engine.eval(tokens, engine.new_cache(64), logits_from=0)
        cache = engine.new_cache(64)
        steps = np.stack([np.asarray(engine.eval(tokens[i:i + 1], cache)).reshape(-1) for i in range(len(tokens))])
    finally:
        engine.close()
    p, q = np.exp(log_softmax(full)), np.exp(log_softmax(steps))
    kl = (p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum(-1)
    assert np.isfinite(kl).all() and np.median(kl) < 1e-3 and (full.argmax(-1) == steps.argmax(-1)).mean() > 0.9, kl
