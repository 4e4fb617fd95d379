"""GGUF tokenizers that match llama.cpp token for token: SentencePiece (`llama`) and byte-level BPE (`gpt2`)."""

from hybrid.errors import TokenizerError

from hybrid.text.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "TokenizerError"]
