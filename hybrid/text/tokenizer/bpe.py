"""Byte-level BPE (`gpt2` model), as llama.cpp's llm_tokenizer_bpe_session.

Each pre-tokenized word starts as one symbol per (byte-level) character; the adjacent pair with the
lowest merge rank is merged first (ties: the leftmost). Results are cached per word: words are
tokenized independently, so the cache cannot change a result.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from hybrid.text.tokenizer.pretokenize import split_words
from hybrid.text.tokenizer.vocab import Vocab

_CACHE_LIMIT = 200_000


class BpeModel:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.spec = vocab.spec
        merges = vocab.merges
        # "left right" -> rank; the first occurrence of a merge wins (llama.cpp: bpe_ranks.emplace).
        # Keying on the whole string equals llama.cpp's split at the first space from index 1, because
        # the symbols looked up never contain a space.
        self.ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self.cache: dict[str, tuple[int, ...]] = {}
        self.gemma4 = self.spec.kind == "gemma4"

    def tokenize(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self.cache
        for word in split_words(text, self.spec):
            ids = cache.get(word)
            if ids is None:
                ids = self._word(word)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _word(self, word: str) -> tuple[int, ...]:
        to_id = self.vocab.token_to_id
        if (self.vocab.ignore_merges or (self.gemma4 and word.strip("\n") == "")) and word in to_id:
            return (to_id[word],)
        parts = self._merge(word)
        out: list[int] = []
        for part in parts:
            tid = to_id.get(part)
            if tid is not None:
                out.append(tid)
                continue
            # no token: llama.cpp tries each byte on its own and drops the ones without a token
            for b in part.encode("utf-8", "surrogateescape"):
                key = bytes([b]).decode("utf-8", "surrogateescape") if self.spec.byte_encode else f"<0x{b:02X}>"
                tid = to_id.get(key)
                if tid is not None:
                    out.append(tid)
        return tuple(out)

    def _merge(self, word: str) -> list[str]:
        n = len(word)
        if n <= 1:
            return [word] if n else []
        ranks = self.ranks
        sym = list(word)  # symbol texts; "" once merged into its left neighbour
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = ranks.get(sym[i] + " " + sym[i + 1])
            if r is not None:
                heap.append((r, i, i + 1, sym[i] + sym[i + 1]))
        heapify(heap)
        while heap:
            _, left, right, text = heappop(heap)
            ls, rs = sym[left], sym[right]
            if not ls or not rs or ls + rs != text:
                continue  # outdated pair
            sym[left] = text
            sym[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            for a, b in ((prev[left], left), (left, after)):
                if a >= 0 and b >= 0:
                    r = ranks.get(sym[a] + " " + sym[b])
                    if r is not None:
                        heappush(heap, (r, a, b, sym[a] + sym[b]))
        return [s for s in sym if s]
