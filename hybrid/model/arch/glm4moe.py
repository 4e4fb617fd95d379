"""glm4moe (GLM-4.5/4.6/4.7, 4.5-Air): q/k/v biases, optional QK-norm, partial NEOX RoPE (rope.dimension_count <
head dim), leading dense layers, then MoE layers with sigmoid gating, the selection bias exp_probs_b, normalized and
scaled weights (metadata) and a shared expert; the pre-FFN norm is named post_attention_norm; NextN/MTP blocks are
not run (gguf_io.config drops them from n_layer)."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="glm4moe", qkv_bias=True, qk_norm=True, moe=True, moe_norm_weights=False,
                aliases=(("post_attention_norm", "ffn_norm"),))
