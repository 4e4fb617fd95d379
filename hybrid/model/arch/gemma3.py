"""gemma3: embeddings scaled by sqrt(n_embd), QK-norm, sandwich norms, GeGLU FFN, sliding-window layers
with their own rope base, q pre-scaled by 1/sqrt(head_dim), tied output."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="gemma3", ffn_act="gelu", qk_norm=True, sandwich_norm=True, embd_scale=True,
                q_scale_in_attention=False)
