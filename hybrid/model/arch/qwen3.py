"""qwen3: per-head RMSNorm of q and k before RoPE, head_dim from attention.key_length, no biases."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="qwen3", qk_norm=True)
