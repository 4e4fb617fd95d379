"""ArchSpec: an architecture's quirks as data (the layer code in `blocks.py` reads them), and the tensors each
layer must have."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ArchSpec:
    name: str
    ffn_act: str = "silu"  # "silu" (SwiGLU), "gelu" (GeGLU, tanh approximation) or "swiglu_oai" (gpt-oss)
    qkv_bias: bool = False  # attn_{q,k,v}.bias added after the projections (qwen2)
    o_bias: bool = False  # attn_output.bias added after the output projection (gpt-oss)
    attn_sinks: bool = False  # attn_sinks: one learned logit per query head in the softmax's denominator (gpt-oss)
    qk_norm: bool = False  # attn_{q,k}_norm: RMSNorm per head before RoPE (qwen3, gemma3)
    sandwich_norm: bool = False  # post_attention_norm / post_ffw_norm after each block (gemma3)
    embd_scale: bool = False  # token embeddings scaled by sqrt(n_embd) (gemma)
    moe: bool = False  # ffn_gate_inp + ffn_{gate,up,down}_exps (qwen3moe); the first cfg.n_layer_dense_lead dense
    moe_norm_weights: bool = True  # renormalize the top-k expert weights to sum 1 (else cfg.expert_weights_norm)
    moe_biases: bool = False  # the router and every expert carry biases (MOE_BIASES; gpt-oss)
    q_scale_in_attention: bool = True  # False: q is pre-scaled by f_attention_scale, attention uses 1.0 (gemma3)
    mla: bool = False  # multi-head latent attention (deepseek2): see mla.py
    # layer tensors the file names otherwise: (file name, our name), renamed at load (glm4moe's pre-FFN norm is
    # `post_attention_norm`)
    aliases: tuple[tuple[str, str], ...] = ()


ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
ATTENTION_MLA = ("attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output")
FFN_DENSE = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
FFN_MOE = ("ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_EXPERT = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# router bias (n_expert,) and per-expert biases (n_expert, n_out), F32: what blocks.moe_ffn adds where a layer has them
MOE_BIASES = ("ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")


def layer_spec(spec: ArchSpec, cfg, il: int, lw=None) -> ArchSpec:
    """The spec layer il runs under: a MoE architecture's leading dense layers (cfg.n_layer_dense_lead) are dense;
    QK-norm only where the layer's weights lw have it (glm4moe's is optional)."""
    if spec.moe and il < cfg.n_layer_dense_lead:
        spec = replace(spec, moe=False)
    if spec.qk_norm and lw is not None and "attn_q_norm" not in lw:
        spec = replace(spec, qk_norm=False)
    return spec


def layer_tensors(spec: ArchSpec, cfg, il: int) -> tuple[str, ...]:
    """The tensors (our names) layer il must have."""
    s = layer_spec(spec, cfg, il)
    if s.mla:
        attn = ATTENTION_MLA + (("attn_q_a", "attn_q_a_norm", "attn_q_b") if cfg.n_lora_q else ("attn_q",))
    else:
        attn = ATTENTION
    attn += ("attn_sinks",) if s.attn_sinks else ()
    attn += ("attn_output.bias",) if s.o_bias else ()
    if not s.moe:
        return attn + FFN_DENSE
    return (attn + FFN_MOE + (SHARED_EXPERT if cfg.n_expert_shared else ())
            + (MOE_BIASES if s.moe_biases else ()))
