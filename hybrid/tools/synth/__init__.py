"""Synthetic GGUF models: random quantized blocks with sane scales, any supported architecture and size."""
