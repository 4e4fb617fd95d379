"""Shared blocks (norm, attention, FFN, MoE FFN) written once against the backend interface,
`hybrid.backends.base.Backend` (its ops, and the fused forms a backend may offer: fused_attention, fused_ffn and
fused_moe return None where it has none, and the ops then run one by one)."""

from __future__ import annotations

import numpy as np

from gguf_io import ModelConfig

from hybrid.model.weights import Weight
from hybrid.model.arch.attend import attend
from hybrid.model.arch.mla import mla_attention
from hybrid.model.arch.moe import moe_layer, route_gated, routing
from hybrid.model.arch.spec import SHARED_EXPERT, ArchSpec, layer_spec


def layer_forward(be, spec: ArchSpec, cfg: ModelConfig, lw: dict[str, Weight], il: int,
                  x: np.ndarray, positions: np.ndarray, kv) -> np.ndarray:
    """One transformer block: x (n_tok, n_embd) float32 -> (n_tok, n_embd)."""
    eps = cfg.f_norm_rms_eps
    spec = layer_spec(spec, cfg, il, lw)  # a leading dense layer of a MoE model runs as a dense one
    # the fused attention forms know neither MLA nor YaRN, attention sinks nor an output bias
    plain = not (spec.mla or cfg.rope_yarn or spec.attn_sinks or spec.o_bias)
    if spec.mla and getattr(kv, "seqs", None) is not None:  # a ragged batch (see attend): MLA's cache is not
        raise NotImplementedError("a batch of several sequences through an MLA layer (deepseek2)")
    whole = getattr(be, "fused_layer", None) if plain else None  # the CPU's: a whole MoE layer in one call
    out = whole(spec, cfg, lw, il, x, positions, kv) if whole is not None else None
    if out is not None:
        return out
    a = be.fused_attention(spec, cfg, lw, il, x, positions, kv) if plain else None
    if a is None:
        h = be.rms_norm(x, lw["attn_norm"].raw, eps)
        if spec.mla:
            base, fscale, _ = rope_params(cfg, il)
            a = mla_attention(be, cfg, lw, il, h, positions, kv, (base, fscale, cfg.rope_yarn))
        else:
            a = attention_block(be, spec, cfg, lw, il, h, positions, kv)
        if spec.sandwich_norm:
            a = be.rms_norm(a, lw["post_attention_norm"].raw, eps)
    out = be.fused_ffn(spec, cfg, lw, x, a)
    if out is not None:
        return out
    x, h = be.add_rms_norm(x, a, lw["ffn_norm"].raw, eps)  # x + a, and its norm
    if spec.moe and not spec.sandwich_norm:  # x + the FFN: on the GPU, added in the experts' weighted sum
        return moe_ffn(be, spec, cfg, lw, h, residual=x)
    f = moe_ffn(be, spec, cfg, lw, h) if spec.moe else ffn(be, spec, lw, h)
    if spec.sandwich_norm:
        f = be.rms_norm(f, lw["post_ffw_norm"].raw, eps)
    return x + f


def rope_params(cfg: ModelConfig, il: int) -> tuple[float, float, int]:
    """(freq_base, freq_scale, n_swa) of layer il: sliding-window layers have their own base and scale (gemma3: 1,
    gpt-oss: the model's)."""
    if cfg.n_swa and cfg.swa_layers[il]:
        return cfg.rope_freq_base_swa, cfg.rope_freq_scale_swa, cfg.n_swa
    return cfg.rope_freq_base, cfg.rope_freq_scale, 0


def attention_block(be, spec: ArchSpec, cfg: ModelConfig, lw: dict[str, Weight], il: int,
                    h: np.ndarray, positions: np.ndarray, kv) -> np.ndarray:
    n = h.shape[0]
    hd_k, hd_v = cfg.n_embd_head_k, cfg.n_embd_head_v
    # (n, n_head*hd_k), (n, n_head_kv*hd_k), (n, n_head_kv*hd_v)
    q, k, v = be.matmuls((lw["attn_q"], lw["attn_k"], lw["attn_v"]), h)
    if spec.qkv_bias:
        q, k, v = (t + lw[f"{name}.bias"].raw for t, name in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
    q = q.reshape(n, cfg.n_head, hd_k)
    k = k.reshape(n, cfg.n_head_kv, hd_k)
    v = v.reshape(n, cfg.n_head_kv, hd_v)
    base, fscale, n_swa = rope_params(cfg, il)
    # the backend's one-kernel form where it has one (QK-norm and RoPE, or RoPE of both)
    wq, wk = (lw["attn_q_norm"].raw, lw["attn_k_norm"].raw) if spec.qk_norm else (None, None)
    qk = be.fused_qk_norm_rope(q, k, wq, wk, cfg.f_norm_rms_eps, positions, cfg.n_rot, base, fscale, cfg.rope_type,
                               cfg.rope_yarn)
    if qk is not None:
        q, k = qk
    else:
        if spec.qk_norm:
            q = be.rms_norm_heads(q, lw["attn_q_norm"].raw, cfg.f_norm_rms_eps)
            k = be.rms_norm_heads(k, lw["attn_k_norm"].raw, cfg.f_norm_rms_eps)
        q = be.rope(q, positions, cfg.n_rot, base, fscale, cfg.rope_type, cfg.rope_yarn)
        k = be.rope(k, positions, cfg.n_rot, base, fscale, cfg.rope_type, cfg.rope_yarn)
    kq_scale = cfg.f_attention_scale
    if not spec.q_scale_in_attention:  # gemma3 scales q before attention and uses a unit kq scale
        q = be.scale(q, kq_scale)
        kq_scale = 1.0
    sinks = lw["attn_sinks"].raw if spec.attn_sinks else None
    o = attend(be, kv, il, q, k, v, positions, kq_scale, n_swa, sinks)  # (n, n_head, hd_v)
    out = be.matmul(lw["attn_output"], o.reshape(n, cfg.n_head * hd_v))
    return out + lw["attn_output.bias"].raw if spec.o_bias else out


def ffn(be, spec: ArchSpec, lw: dict[str, Weight], h: np.ndarray) -> np.ndarray:
    g, u = be.matmuls((lw["ffn_gate"], lw["ffn_up"]), h)
    return be.matmul(lw["ffn_down"], be.glu(g, u, spec.ffn_act))


def route(router_logits: np.ndarray, n_used: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax router -> (expert ids (n, k), weights (n, k) f32); weights renormalized to sum 1 when asked
    (llama.cpp clamps the sum at 6.1e-5). The softmax and the sum are taken in float64 (exp of the float32
    differences, left-to-right sums, one rounding to float32), as ggml sums in double: a compiled routing
    (kernels_cpu.moe_route) reproduces them bit for bit, which numpy's own float32 exp would not allow."""
    z = (router_logits - router_logits.max(axis=1, keepdims=True)).astype(np.float64)
    e = np.exp(z)
    p = (e / np.cumsum(e, axis=1)[:, -1:]).astype(np.float32)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :n_used]
    w = np.take_along_axis(p, ids, axis=1)
    if normalize:
        total = np.cumsum(w, axis=1, dtype=np.float64)[:, -1:].astype(np.float32)
        w = w / np.maximum(total, np.float32(6.103515625e-5))
    return ids, w.astype(np.float32)


def route_layer(spec: ArchSpec, cfg: ModelConfig, lw: dict[str, Weight], logits: np.ndarray, to_host=np.asarray):
    """A MoE layer's routing of its router's logits (host float32 (n, n_expert)) on the host: the router's bias
    added (gpt-oss), then plain softmax top-k (`route`) or the gated forms (`route_gated`: sigmoid, the selection
    bias exp_probs_b, groups, a scale, softmax of the selected). -> (ids int64 (n, k), weights float32 (n, k))."""
    if "ffn_gate_inp.bias" in lw:  # gpt-oss
        logits = logits + np.asarray(to_host(lw["ffn_gate_inp.bias"].raw), dtype=np.float32)
    r = routing(spec, cfg)
    bias = lw.get("exp_probs_b.bias")
    if r.plain and bias is None:
        return route(logits, cfg.n_expert_used, r.normalize)
    return route_gated(logits, r, None if bias is None else np.asarray(to_host(bias.raw)))


def expert_biases(be, lw: dict[str, Weight], name: str):
    """The per-expert bias rows of `name` (n_expert, n_out) f32 on be's device (a 2-D F32 tensor is held as raw
    bytes, as a matrix), or None where the layer has none."""
    w = lw.get(name)
    if w is None:
        return None
    raw = w.f32()
    return be.from_host(raw) if isinstance(raw, np.ndarray) else raw


def moe_ffn(be, spec: ArchSpec, cfg: ModelConfig, lw: dict[str, Weight], h: np.ndarray,
            residual: np.ndarray | None = None) -> np.ndarray:
    """Top-k experts per token, plus the shared expert where the layer has one: the routed experts through the
    backend's fused form where it has one (Backend.fused_moe: the CPU's for every routing, a GPU's for plain
    softmax), else op by op with the routing on the host and tokens grouped by expert, so each expert's weights
    are read once per batch. residual: when given, the result is residual + all that (the same sums: the fused
    form adds it to the routed experts' only where no shared expert follows)."""
    shared = SHARED_EXPERT[0] in lw
    fused_res = None if shared else residual
    out = be.fused_moe(spec, cfg, lw, h, fused_res)  # None where the backend has no fused form here
    if out is not None and fused_res is not None:
        return out
    if out is None:
        logits = np.asarray(be.to_host(be.matmul(lw["ffn_gate_inp"], h)), dtype=np.float32)  # (n, n_expert)
        ids, w = route_layer(spec, cfg, lw, logits, be.to_host)
        observer = getattr(be, "routing_observer", None)  # moe.RoutingObserver; a test's backend may lack it
        if observer is not None:
            observer.routed(moe_layer(lw), ids, w)
        out = be.zeros((h.shape[0], cfg.n_embd))
        bg, bu, bd = (expert_biases(be, lw, f"{t}.bias") for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            xe = be.take_rows(h, rows)
            g, u = be.matmuls((lw["ffn_gate_exps"].expert(int(e)), lw["ffn_up_exps"].expert(int(e))), xe)
            g = g if bg is None else g + bg[e]
            u = u if bu is None else u + bu[e]
            d = be.matmul(lw["ffn_down_exps"].expert(int(e)), be.glu(g, u, spec.ffn_act))
            if bd is not None:
                d = d + bd[e]
            be.scatter_add(out, rows, d, w[rows, slot])
    if shared:
        g, u = be.matmuls((lw["ffn_gate_shexp"], lw["ffn_up_shexp"]), h)
        out = out + be.matmul(lw["ffn_down_shexp"], be.glu(g, u, spec.ffn_act))
    return out if residual is None else residual + out
