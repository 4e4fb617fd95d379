"""gpt-oss (OpenAI's gpt-oss-20b/120b; llama.cpp's openai-moe): biases on q/k/v/o, attention sinks, sliding-window
layers alternating with full ones (gguf_io.config), NEOX RoPE with YaRN, then in every layer a MoE FFN whose
router and experts carry biases, top-k of the raw router logits weighted by the softmax of the k selected
(routing "softmax_weight"), and the clamped SwiGLU swiglu_oai; the pre-FFN norm is named post_attention_norm; the
output matrix is not tied."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="gpt-oss", ffn_act="swiglu_oai", qkv_bias=True, o_bias=True, attn_sinks=True, moe=True,
                moe_norm_weights=False, moe_biases=True, aliases=(("post_attention_norm", "ffn_norm"),))
