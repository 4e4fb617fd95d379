"""ArchSpec: an architecture's quirks as data (the layer code in `blocks.py` reads them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    name: str
    ffn_act: str = "silu"  # "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    qkv_bias: bool = False  # attn_{q,k,v}.bias added after the projections (qwen2)
    qk_norm: bool = False  # attn_{q,k}_norm: RMSNorm per head before RoPE (qwen3, gemma3)
    sandwich_norm: bool = False  # post_attention_norm / post_ffw_norm after each block (gemma3)
    embd_scale: bool = False  # token embeddings scaled by sqrt(n_embd) (gemma)
    moe: bool = False  # ffn_gate_inp + ffn_{gate,up,down}_exps (qwen3moe)
    moe_norm_weights: bool = True  # renormalize the top-k expert weights to sum 1
    q_scale_in_attention: bool = True  # False: q is pre-scaled by f_attention_scale, attention uses 1.0 (gemma3)


# Tensors every architecture needs per layer; optional ones are looked up by the blocks when the spec asks.
LAYER_TENSORS_DENSE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
LAYER_TENSORS_MOE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp",
                     "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
