"""llama (also Mistral-style files): GQA, NORM RoPE, SwiGLU FFN, pre-norm blocks."""

from .spec import ArchSpec

SPEC = ArchSpec(name="llama")
