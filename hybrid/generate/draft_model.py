"""Drafting with a smaller model of the same vocabulary (llama.cpp's `-md/--model-draft`).

ModelDrafter keeps its own KV cache following the target's sequence: each `propose` keeps the longest prefix its
cache shares with the sequence (the accepted drafts stay; what the target rejected is rolled back by n_past),
evaluates the new tokens in one batch, then drafts greedily one token per step, stopping after n_max tokens, after
an end-of-generation token, or before a token whose probability under the draft model is below p_min
(`--draft-p-min`). The last drafted token is
not evaluated (nothing would read its logits); it is evaluated with the next call's new tokens if accepted.

`check_vocab` refuses a draft model whose token texts differ from the target's, as llama.cpp does
(`common_speculative_are_compatible`), except that differences in padding tokens (unused or reserved slots that
no text encodes to) are allowed, and so are extra padding tokens at the end of either vocabulary.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from hybrid.errors import HybridError
from hybrid.kv.cache import KVCache

TOKEN_UNUSED = 5  # GGUF token type of a slot no text maps to
# texts of the padding and reserved slots model files fill their vocabularies with
_PADDING = re.compile(r"<pad>|\[PAD\d*\]|<\|?pad(_?\d+)?\|?>|<unused\d+>|<\|reserved_special_token_\d+\|>|"
                      r"\[control_\d+\]|<extra_id_\d+>|<\|extra_\d+\|>", re.IGNORECASE)


class VocabMismatch(HybridError):
    """The draft model cannot draft for the target: their vocabularies differ."""


def _is_padding(vocab, i: int) -> bool:
    return (i < vocab.n_tokens and (int(vocab.token_types[i]) == TOKEN_UNUSED or i == vocab.pad
                                    or _PADDING.fullmatch(vocab.tokens[i]) is not None))


def check_vocab(target, draft) -> None:
    """VocabMismatch, naming the first differing token, unless the draft tokenizer's vocabulary is the target's
    (token for token, padding slots aside) with the same BOS/EOS handling."""
    tv, dv = target.vocab, draft.vocab
    if tv.kind != dv.kind:
        raise VocabMismatch(f"the draft model's tokenizer is {dv.kind.upper()}, the target's {tv.kind.upper()}")
    for name in ("bos", "eos"):
        if getattr(tv, f"add_{name}") != getattr(dv, f"add_{name}") or getattr(tv, name) != getattr(dv, name):
            raise VocabMismatch(f"the draft model's {name.upper()} token ({getattr(dv, name)}, added: "
                                f"{getattr(dv, f'add_{name}')}) is not the target's ({getattr(tv, name)}, added: "
                                f"{getattr(tv, f'add_{name}')})")
    n = min(tv.n_tokens, dv.n_tokens)
    for i in range(n):
        if tv.tokens[i] != dv.tokens[i] and not (_is_padding(tv, i) and _is_padding(dv, i)):
            raise VocabMismatch(f"the draft model's vocabulary differs from the target's at token {i}: "
                                f"{tv.tokens[i]!r} in the target, {dv.tokens[i]!r} in the draft")
    longer = tv if tv.n_tokens > dv.n_tokens else dv
    for i in range(n, longer.n_tokens):
        if not _is_padding(longer, i):
            who = "target" if longer is tv else "draft"
            raise VocabMismatch(f"the draft model's vocabulary differs from the target's at token {i}: "
                                f"{longer.tokens[i]!r} only in the {who} ({tv.n_tokens} tokens against "
                                f"{dv.n_tokens})")


def _top1(logits: np.ndarray, n_vocab: int) -> tuple[int, float]:
    """The most likely token below n_vocab (the target's vocabulary) and its probability under the softmax."""
    z = logits[:n_vocab].astype(np.float64)
    t = int(np.argmax(z))
    return t, float(1.0 / np.exp(z - z[t]).sum())


class ModelDrafter:
    """Greedy drafts from a draft engine (hybrid.engine.Engine) with its own KV cache.

    around_eval: a context-manager factory wrapped around the draft model's evaluations (the CLI's sets -td threads
    there and back); None: evaluations run as they are."""

    def __init__(self, engine, n_vocab: int, p_min: float = 0.75, cache: KVCache | None = None,
                 around_eval: Callable | None = None):
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {p_min}")
        self.engine = engine
        self.n_vocab = min(n_vocab, engine.config.n_vocab)  # drafts are target token ids
        self.p_min = p_min
        self.cache = cache if cache is not None else engine.new_cache()
        self.cached: list[int] = []  # the tokens whose K/V the draft cache holds, in order
        self.around_eval = around_eval
        self.evals = 0  # draft model evaluations (the sync batch and one per drafted token but the last)

    def prefill(self, tokens: list[int]) -> None:
        """Evaluate a prompt into the draft cache ahead of the first draft (during the target's prompt), so that the
        first draft evaluates only the token that follows it."""
        if tokens:
            self._with_threads(self._sync, list(tokens))

    def propose(self, tokens: list[int], n_max: int) -> list[int]:
        if n_max < 1 or not tokens:
            return []
        room = self.cache.n_ctx - len(tokens)  # the draft cache fills like the target's: stop where it is full
        n_max = min(n_max, room)
        if n_max < 1:
            return []
        return self._with_threads(self._draft, tokens, n_max)

    def _with_threads(self, fn, *args):
        if self.around_eval is None:
            return fn(*args)
        with self.around_eval():
            return fn(*args)

    def _sync(self, tokens: list[int]):
        """Keep the longest cached prefix of tokens (all but the last at most), evaluate the rest in -b batches:
        the logits of tokens' last one."""
        common = 0
        for a, b in zip(tokens, self.cached):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is evaluated for its logits
        self.cache.n_past = common
        self.cached = list(tokens[:common])
        batch = self.engine.params.n_batch
        logits = None
        for s in range(common, len(tokens), batch):
            logits = self.engine.eval(tokens[s : s + batch], self.cache)
            self.evals += 1
        self.cached = list(tokens)
        return logits

    def _draft(self, tokens: list[int], n_max: int) -> list[int]:
        logits = self._sync(tokens)
        draft: list[int] = []
        while True:
            t, p = _top1(logits, self.n_vocab)
            if p < self.p_min:
                break
            draft.append(t)
            if len(draft) >= n_max or self.engine.tokenizer.is_eog(t):  # nothing follows an end of generation
                break
            logits = self.engine.eval([t], self.cache)
            self.evals += 1
            self.cached.append(t)
        return draft
