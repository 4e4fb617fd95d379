"""qwen2: llama with q/k/v biases and NEOX RoPE (the rope style comes from ModelConfig.rope_type)."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="qwen2", qkv_bias=True)
