"""Tokenizer metadata for synthetic models: a small SentencePiece-style vocabulary, or one copied from a GGUF.

Both return `(key, value, GGUF value type)` triples for `gguf_io.writer.layout`; the tokens are always the
second triple, so callers can read the final vocabulary size.
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path

import numpy as np

from gguf_io import open_gguf
from gguf_io.metadata import ARRAY, BOOL, F32, I32, STRING, U32

# llama_token_type: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED, _BYTE = 1, 2, 3, 5, 6


def _pieces():
    """'▁', then '▁a', 'a', '▁b', 'b', ... for words of 1, 2, 3, ... lowercase letters: endless and unique."""
    yield "\u2581"
    for n in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            w = "".join(letters)
            yield "\u2581" + w
            yield w


def synthetic_vocab(n_vocab: int) -> list[tuple[str, object, object]]:
    """An SPM ("llama") vocabulary of `n_vocab` tokens: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>,
    then letter pieces with decreasing scores. BOS 1 (added), EOS 2: any text encodes via byte fallback."""
    if n_vocab < 3 + 256:
        raise ValueError(f"a synthetic vocabulary needs at least 259 tokens (3 special + 256 bytes), got {n_vocab}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += list(itertools.islice(_pieces(), n_vocab - len(tokens)))
    n_words = n_vocab - 259
    scores = np.concatenate([np.zeros(259, np.float32), -np.arange(n_words, dtype=np.float32)])
    types = np.array([_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL] * n_words, dtype=np.int32)
    return [("tokenizer.ggml.model", "llama", STRING), ("tokenizer.ggml.tokens", tokens, (ARRAY, STRING)),
            ("tokenizer.ggml.scores", scores, (ARRAY, F32)), ("tokenizer.ggml.token_type", types, (ARRAY, I32)),
            ("tokenizer.ggml.bos_token_id", 1, U32), ("tokenizer.ggml.eos_token_id", 2, U32),
            ("tokenizer.ggml.unknown_token_id", 0, U32), ("tokenizer.ggml.add_bos_token", True, BOOL),
            ("tokenizer.ggml.add_eos_token", False, BOOL)]


def vocab_from_gguf(path: str | Path, n_vocab: int) -> list[tuple[str, object, object]]:
    """Every `tokenizer.*` key of the GGUF at `path`, with its GGUF type. When the vocabulary has fewer than
    `n_vocab` tokens it is padded as convert_hf_to_gguf does ("[PAD{i}]", type UNUSED, score 0)."""
    with open_gguf(path) as f:
        md, types = dict(f.metadata), dict(f.metadata_types)
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens: not a vocabulary GGUF")
    n_tok = len(tokens)
    out = [("tokenizer.ggml.model", md.pop("tokenizer.ggml.model", "llama"), STRING),
           ("tokenizer.ggml.tokens", tokens + [f"[PAD{i}]" for i in range(n_tok, n_vocab)], (ARRAY, STRING))]
    types.pop("tokenizer.ggml.model", None)
    for key, value in md.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.ggml.tokens":
            continue
        if isinstance(value, np.ndarray) and len(value) == n_tok and n_vocab > n_tok:  # per-token arrays
            fill = _UNUSED if key == "tokenizer.ggml.token_type" else 0
            value = np.concatenate([value, np.full(n_vocab - n_tok, fill, value.dtype)])
        out.append((key, value, types[key]))
    return out
