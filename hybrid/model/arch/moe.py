"""MoE routing beyond qwen3moe's softmax (llama.cpp's build_moe_ffn): sigmoid gating, gpt-oss's softmax over the
selected logits, the selection bias exp_probs_b (selection only), group-limited selection, renormalized and scaled
weights; and which layers keep to plain softmax routing with unbiased experts and a SwiGLU/GeGLU, the kind the CPU's
compiled routing and one-call decode form implement (the others are routed on the host; the GPU's kernels route
every form on the device: kernels_gpu.moe.Router).

The numbers are taken so compiled code can repeat them bit for bit (kernels_cpu.moe_route): the softmax or the
sigmoid in float64 rounded once to float32, the bias added in float32, the renormalizing sum in float64 rounded
once, the scale a float32 product."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gguf_io import ModelConfig

from hybrid.model.arch.spec import MOE_BIASES, ArchSpec

FUSED_ACTS = ("silu", "gelu")  # the GLUs the fused MoE forms implement
MOE_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp clamps the renormalizing sum here (2**-14)


@dataclass(frozen=True)
class Routing:
    """How a layer picks and weighs its experts."""

    n_used: int
    gating: str  # "softmax" or "sigmoid" of the router logits, or "softmax_weight": top k of the logits, weights
    # the softmax of the k selected (gpt-oss)
    normalize: bool  # selected weights renormalized to sum 1
    scale: float  # selected weights times this (1.0: none)
    n_groups: int  # > 1: group-limited selection (DeepSeek V3)
    n_group_used: int

    @property
    def plain(self) -> bool:
        """Softmax, the top n_used, optionally renormalized: what blocks.route and the fused MoE forms compute."""
        return self.gating == "softmax" and self.scale == 1.0 and self.n_groups <= 1


class RoutingObserver(Protocol):
    """Hears every MoE layer's routing while a backend's `routing_observer` is set (Engine.observe_routing):
    `hybrid trace-experts` records it. Backends call it with the ids and weights their routing produced (the
    compiled, device or op-by-op one), copied to the host; None (the default) costs one test per MoE layer."""

    def routed(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """layer: the model's layer index; ids (n_tok, k) int, weights (n_tok, k) float32, in the routing's order."""


_LAYER_NAME = re.compile(r"blk\.(\d+)\.")


def moe_layer(lw) -> int:
    """The layer index of a MoE layer's weights, from its router's GGUF name (blk.{il}.ffn_gate_inp.weight): the
    fused forms are not given the index, and the name travels with the weight to every device."""
    name = lw["ffn_gate_inp"].name
    m = _LAYER_NAME.match(name)
    if m is None:
        raise ValueError(f"expected a router named blk.<layer>.ffn_gate_inp.weight, found {name!r}")
    return int(m.group(1))


def routing(spec: ArchSpec, cfg: ModelConfig) -> Routing:
    """A MoE layer's routing from the spec (qwen3moe renormalizes by definition) and the metadata."""
    scale = cfg.expert_weights_scale
    return Routing(cfg.n_expert_used, cfg.expert_gating_func, spec.moe_norm_weights or cfg.expert_weights_norm,
                   1.0 if scale in (0.0, 1.0) else scale, cfg.n_expert_groups, cfg.n_group_used)


def fused_moe_ok(spec: ArchSpec, cfg: ModelConfig, lw) -> bool:
    """Whether a MoE layer's routing is plain softmax with no selection bias, its router and experts carry no
    biases and its GLU is SwiGLU or GeGLU: what the CPU's compiled routing (kernels_cpu.moe_route) and its one-call
    decode form implement. A shared expert is added by blocks.moe_ffn after them, so it does not count."""
    return (routing(spec, cfg).plain and spec.ffn_act in FUSED_ACTS and "exp_probs_b.bias" not in lw
            and not any(b in lw for b in MOE_BIASES))


def route_gated(logits: np.ndarray, r: Routing, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """logits (n, n_expert) f32 -> (expert ids (n, k) int64, weights (n, k) f32): probs by r.gating; selection by
    probs + bias (bias (n_expert,) f32 or None), within the best r.n_group_used groups (a group scores the sum of
    its 2 best) when r.n_groups > 1, the top k (ties: the lower expert); weights the unbiased probs of the
    selected ("softmax_weight": the softmax of the selected logits), renormalized (sum clamped at 2**-14) and
    scaled as r says."""
    z = np.asarray(logits, dtype=np.float32)
    if r.gating == "softmax":
        e = np.exp((z - z.max(axis=1, keepdims=True)).astype(np.float64))
        p = (e / np.cumsum(e, axis=1)[:, -1:]).astype(np.float32)
    elif r.gating == "sigmoid":
        p = (1.0 / (1.0 + np.exp(-z.astype(np.float64)))).astype(np.float32)
    elif r.gating == "softmax_weight":
        p = z  # selection on the raw logits; the weights are the softmax of the selected ones (below)
    else:
        raise ValueError(f"route: unknown gating {r.gating!r}")
    sel = p + np.asarray(bias, dtype=np.float32) if bias is not None else p
    if r.n_groups > 1:
        n, n_expert = sel.shape
        groups = sel.reshape(n, r.n_groups, n_expert // r.n_groups)
        top2 = -np.sort(-groups, axis=2)[:, :, :2]
        score = top2[:, :, 0] + top2[:, :, 1] if top2.shape[2] > 1 else top2[:, :, 0]
        keep = np.argsort(-score, axis=1, kind="stable")[:, :r.n_group_used]  # (n, n_group_used)
        mask = np.ones((n, r.n_groups), dtype=bool)
        np.put_along_axis(mask, keep, False, axis=1)
        sel = np.where(np.repeat(mask, n_expert // r.n_groups, axis=1), np.float32(-np.inf), sel)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :r.n_used]
    w = np.take_along_axis(p, ids, axis=1)
    if r.gating == "softmax_weight":
        e = np.exp((w - w.max(axis=1, keepdims=True)).astype(np.float64))
        w = (e / np.cumsum(e, axis=1)[:, -1:]).astype(np.float32)
    if r.normalize:
        total = np.cumsum(w, axis=1, dtype=np.float64)[:, -1:].astype(np.float32)
        w = w / np.maximum(total, MOE_SUM_MIN)
    if r.scale != 1.0:
        w = w * np.float32(r.scale)
    return ids.astype(np.int64), w.astype(np.float32)
