"""llama (also Mistral-style files): GQA, NORM RoPE, SwiGLU FFN, pre-norm blocks."""

from hybrid.model.arch.spec import ArchSpec

SPEC = ArchSpec(name="llama")
