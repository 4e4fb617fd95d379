"""qwen3moe: qwen3 attention; MoE FFN with softmax router, top-k experts, weights renormalized to sum 1."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="qwen3moe", qk_norm=True, moe=True, moe_norm_weights=True)
