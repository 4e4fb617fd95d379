"""SentencePiece-style (`llama` model) tokenization, as llama.cpp's llm_tokenizer_spm_session.

The whole text (spaces already escaped to U+2581) starts as one symbol per character; the adjacent pair
whose concatenation is a token with the highest score is merged first (ties: the leftmost), using a heap
of candidate pairs and a linked list of symbols. Symbols that end up not being tokens fall back to
byte tokens <0xXX>.
"""

from __future__ import annotations

from array import array
from heapq import heapify, heappop, heappush

import numpy as np

from hybrid.errors import TokenizerError

from hybrid.text.tokenizer.vocab import Vocab

# A heap entry is one int, ((priority * _IDX + left) * _LEN + left_size) * _LEN + merged_size, so the heap
# pops the highest score, then the leftmost pair (llama.cpp's llm_bigram_spm::comparator), and compares
# fast. Symbol i always starts at character i (a merged symbol keeps its left part's index), so the right
# symbol of a pair is left + left_size.
_LEN = 1 << 20
_IDX = 1 << 32


def byte_token(vocab: Vocab, byte: int) -> int:
    """llama_vocab::byte_to_token for SPM: <0xXX>, else the byte itself as a one-byte token."""
    tid = vocab.token_to_id.get(f"<0x{byte:02X}>")
    if tid is None:
        tid = vocab.token_to_id.get(bytes([byte]).decode("utf-8", "surrogateescape"))
    if tid is None:
        raise TokenizerError(f"byte 0x{byte:02X} has no token (<0x{byte:02X}>) in this SentencePiece vocab")
    return tid


class SpmModel:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        # priority per token: equal scores share one, a higher score gets a smaller one
        _, rank = np.unique(-np.asarray(vocab.scores, np.float64), return_inverse=True)
        # array('q'), not a list: 8 bytes a token instead of ~40 (262k-token vocabs), at the same lookup speed
        self.priority = array("q", (rank.astype(np.int64) * _IDX).tobytes())

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one text fragment (already prefixed/escaped by the caller)."""
        n = len(text)
        if n == 0:
            return []
        get = self.vocab.token_to_id.get
        prio = self.priority
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1

        heap = []
        for i in range(n - 1):
            tid = get(text[i : i + 2])
            if tid is not None:
                heap.append(((prio[tid] + i) * _LEN + 1) * _LEN + 2)
        heapify(heap)
        while heap:
            key = heappop(heap)
            key, length = divmod(key, _LEN)
            key, left_size = divmod(key, _LEN)
            left = key % _IDX
            if size[left] != left_size:
                continue  # the left symbol was merged since this pair was queued
            right = left + left_size
            right_size = size[right]
            if right_size == 0 or left_size + right_size != length:
                continue  # so was the right one
            size[left] = length
            size[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            p = prev[left]
            if p >= 0:
                tid = get(text[p : left + length])
                if tid is not None:
                    heappush(heap, ((prio[tid] + p) * _LEN + size[p]) * _LEN + size[p] + length)
            if after >= 0:
                tid = get(text[left : after + size[after]])
                if tid is not None:
                    heappush(heap, ((prio[tid] + left) * _LEN + length) * _LEN + length + size[after])

        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[i : i + size[i]]
            tid = get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(byte_token(self.vocab, b) for b in piece.encode("utf-8", "surrogateescape"))
            i = nxt[i]
        return out
