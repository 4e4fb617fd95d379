"""`Tokenizer`: the public face of hybrid.text.tokenizer, with llama.cpp's llama_tokenize / llama_detokenize semantics."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from hybrid.errors import TokenizerError

from hybrid.text.tokenizer.bpe import BpeModel
from hybrid.text.tokenizer.detokenize import PieceCache, clean_spaces
from hybrid.text.tokenizer.special import partition
from hybrid.text.tokenizer.spm import SpmModel
from hybrid.text.tokenizer.vocab import ATTR_CONTROL, NULL, Vocab, load_vocab

_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """A GGUF model's tokenizer (SPM `llama` or byte-level BPE `gpt2`), matching llama.cpp token for token."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._bpe = BpeModel(vocab) if vocab.kind == "bpe" else None
        self._spm = SpmModel(vocab) if vocab.kind == "spm" else None
        self._pieces = PieceCache(vocab)

    @classmethod
    def from_metadata(cls, metadata: Mapping) -> Tokenizer:
        """Build from GGUF metadata (GGUFFile.metadata); raises TokenizerError when it is missing or bad."""
        return cls(load_vocab(dict(metadata)))

    # -- text -> ids --------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize: add_special adds BOS/EOS as the model asks; parse_special maps "<bos>" etc. to tokens."""
        v = self.vocab
        if _SURROGATE.search(text):  # lone surrogates are not UTF-8; llama.cpp would see U+FFFD
            text = _SURROGATE.sub("\ufffd", text)
        out: list[int] = []
        if add_special and v.add_bos:
            if v.bos == NULL:
                raise TokenizerError("the model asks for a BOS token (add_bos_token) but defines none")
            out.append(v.bos)
        is_prev_special = True  # SPM: prefix a space at the start and after each special token
        for frag in partition(v, text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                is_prev_special = True
                continue
            piece = text[frag[0] : frag[1]]
            if self._spm is not None:
                if v.add_space_prefix and is_prev_special:
                    piece = " " + piece
                out.extend(self._spm.tokenize(piece.replace(" ", "\u2581")))
                is_prev_special = False
            else:
                if v.escape_whitespaces:
                    piece = piece.replace(" ", "\u2581")
                out.extend(self._bpe.tokenize(piece))
        if add_special and v.add_eos:
            if v.eos == NULL:
                raise TokenizerError("the model asks for an EOS token (add_eos_token) but defines none")
            out.append(v.eos)
        return out

    # -- ids -> text --------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """llama_detokenize: remove_special drops the BOS/EOS the model adds; unparse_special renders control tokens."""
        return self.decode_bytes(ids, remove_special, unparse_special).decode("utf-8", "replace")

    def decode_bytes(self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> bytes:
        ids = [self._check(i) for i in ids]
        return self._pieces.detokenize(ids, remove_special, unparse_special)

    def decode_piece(self, token_id: int, first: bool, unparse_special: bool = False) -> bytes:
        """The bytes token_id adds to decode_bytes(ids) (remove_special off) when appended to ids (first: ids was
        empty), before the clean-up of spaces (clean_text): a stream of tokens decodes in time linear in its
        length."""
        return self._pieces.piece(self._check(token_id), unparse_special, first and self.vocab.add_space_prefix)

    def clean_text(self, raw: bytes) -> bytes:
        """decode_bytes' last step on joined pieces: llama.cpp's clean-up of spaces where the vocab asks for it."""
        return clean_spaces(raw) if self.vocab.clean_spaces else raw

    def piece(self, token_id: int, special: bool = True) -> str:
        """llama_token_to_piece as text (a lone part of a multi-byte character shows as U+FFFD)."""
        return self.piece_bytes(token_id, special).decode("utf-8", "replace")

    def piece_bytes(self, token_id: int, special: bool = True) -> bytes:
        """llama_token_to_piece: the token's bytes; special=False renders control tokens as nothing."""
        return self._pieces.piece(self._check(token_id), special)

    # -- vocabulary ---------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_tokens

    @property
    def bos_id(self) -> int | None:
        return None if self.vocab.bos == NULL else self.vocab.bos

    @property
    def eos_id(self) -> int | None:
        return None if self.vocab.eos == NULL else self.vocab.eos

    @property
    def eot_id(self) -> int | None:
        return None if self.vocab.eot == NULL else self.vocab.eot

    @property
    def eog_ids(self) -> set[int]:
        return set(self.vocab.eog_ids)

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def model(self) -> str:
        """tokenizer.ggml.model ("llama" = SentencePiece, "gpt2" = byte-level BPE)."""
        return self.vocab.model

    @property
    def pre(self) -> str:
        return self.vocab.pre

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def is_control(self, token_id: int) -> bool:
        return bool(self.vocab.attrs[self._check(token_id)] & ATTR_CONTROL)

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return int(self.vocab.token_types[self._check(token_id)])

    def token_attr(self, token_id: int) -> int:
        """llama.cpp's llama_token_attr bits for the token (after its text-based adjustments)."""
        return self.vocab.attrs[self._check(token_id)]

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocab (SPM spaces as U+2581, BPE bytes as GPT-2 characters)."""
        return self.vocab.tokens[self._check(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of the vocab entry with exactly this text, if any."""
        return self.vocab.token_to_id.get(text)

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab.n_tokens:
            raise TokenizerError(f"token id {token_id} is out of range (n_vocab {self.vocab.n_tokens})")
        return token_id

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"
