"""Cut text at special tokens before tokenizing the rest, as llama.cpp's tokenizer_st_partition.

Special tokens are the CONTROL, USER_DEFINED and UNKNOWN ones, longest text first; each in turn splits
every remaining text fragment at all its occurrences. With parse_special=False only USER_DEFINED
tokens split (llama.cpp, following HF tokenizers). LSTRIP/RSTRIP eat the ASCII whitespace beside a token.
"""

from __future__ import annotations

from hybrid.text.tokenizer.vocab import ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNKNOWN, Vocab

_C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale


def _candidates(vocab: Vocab, text: str, parse_special: bool) -> list[int]:
    """The special tokens, in partition order, that occur in text at all (the rest cannot split it)."""
    grams = {text[i : i + 2] for i in range(len(text) - 1)}
    chars = set(text)
    tokens, attrs = vocab.tokens, vocab.attrs
    out = []
    for tid in vocab.special_tokens:
        if not parse_special and attrs[tid] & (ATTR_CONTROL | ATTR_UNKNOWN):
            continue
        t = tokens[tid]
        if (t[:2] in grams if len(t) > 1 else t in chars) and t in text:
            out.append(tid)
    return out


def partition(vocab: Vocab, text: str, parse_special: bool) -> list:
    """Fragments of text: special token ids and (start, stop) slices of plain text, in order."""
    if not text:
        return []
    frags: list = [(0, len(text))]
    for tid in _candidates(vocab, text, parse_special):
        tok = vocab.tokens[tid]
        attr = vocab.attrs[tid]
        lstrip, rstrip = attr & ATTR_LSTRIP, attr & ATTR_RSTRIP
        new: list = []
        for frag in frags:
            if isinstance(frag, int):
                new.append(frag)
                continue
            s, e = frag
            while True:
                m = text.find(tok, s, e)
                if m < 0:
                    if e > s:
                        new.append((s, e))
                    break
                left_end = m
                if lstrip:
                    while left_end > s and text[left_end - 1] in _C_SPACE:
                        left_end -= 1
                if left_end > s:
                    new.append((s, left_end))
                new.append(tid)
                s = m + len(tok)
                if rstrip:
                    while s < e and text[s] in _C_SPACE:
                        s += 1
        frags = new
    return frags
