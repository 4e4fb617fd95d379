"""Hand-written word splitters that llama.cpp uses instead of std::regex for its most common patterns.

Each follows llama.cpp's `unicode_regex_split_custom_*` (unicode.cpp) step by step, quirks included, so
word boundaries match llama.cpp rather than a textbook regex engine. A splitter takes the text's
codepoints, their flags (`unicode.cpt_flags`) and the current segment lengths, and returns new lengths.
"""

from __future__ import annotations

from hybrid.text.tokenizer.unicode import ACCENT_MARK, LETTER, NUMBER, WHITESPACE

_CR, _LF, _SPACE, _APOS = 0x0D, 0x0A, 0x20, 0x27
_OUT = -1  # a position outside the current segment
_CONTRACTION_1 = (ord("s"), ord("t"), ord("m"), ord("d"))
_CONTRACTION_2 = ((ord("r"), ord("e")), (ord("v"), ord("e")), (ord("l"), ord("l")))
_WLN = WHITESPACE | LETTER | NUMBER


def _lower_ascii(c: int) -> int:
    # unicode_tolower: only its results for the contraction letters matter, and only A-Z map onto those.
    return c + 32 if 0x41 <= c <= 0x5A else c


def _contraction(cpts: list[int], pos: int, end: int, fold: bool) -> int:
    """Length of a 's 't 're 've 'm 'll 'd contraction at pos (0 if none)."""
    if cpts[pos] != _APOS or pos + 1 >= end:
        return 0
    c1 = _lower_ascii(cpts[pos + 1]) if fold else cpts[pos + 1]
    if c1 in _CONTRACTION_1:
        return 2
    if pos + 2 < end:
        c2 = _lower_ascii(cpts[pos + 2]) if fold else cpts[pos + 2]
        if (c1, c2) in _CONTRACTION_2:
            return 3
    return 0


def split_gpt2(cpts: list[int], flags: list[int], offsets: list[int]) -> list[int]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S) (unicode_regex_split_custom_gpt2)."""
    out: list[int] = []
    start = 0
    for off in offsets:
        end = start + off
        pos = start
        start = end

        def fl(p: int) -> int:
            return flags[p] if p < end else 0

        while pos < end:
            cpt = cpts[pos]
            n = _contraction(cpts, pos, end, fold=False)
            if n:
                out.append(n)
                pos += n
                continue
            first = pos
            f2 = fl(pos + 1) if cpt == _SPACE else flags[pos]
            if f2 & LETTER or f2 & NUMBER:
                cls = LETTER if f2 & LETTER else NUMBER
                pos += cpt == _SPACE
                while f2 & cls:
                    pos += 1
                    f2 = fl(pos)
            elif not (f2 & _WLN) and f2:
                pos += cpt == _SPACE
                while not (f2 & _WLN) and f2:
                    pos += 1
                    f2 = fl(pos)
            else:
                n_ws = 0
                while fl(pos + n_ws) & WHITESPACE:
                    n_ws += 1
                if n_ws > 1 and pos + n_ws < end:
                    pos += n_ws - 1  # \s+(?!\S): leave the last space for the next word
                elif n_ws > 0:
                    pos += n_ws
                else:
                    pos += 1
            out.append(pos - first)
    return out


def _split_llama3_like(cpts, flags, offsets, digits: int, marks: bool) -> list[int]:
    """The llama3 (digits=3), qwen2 (digits=1) and qwen35 (digits=1, marks) splitters."""
    out: list[int] = []
    word_cls = LETTER | ACCENT_MARK if marks else LETTER
    not_punct = WHITESPACE | LETTER | NUMBER | (ACCENT_MARK if marks else 0)
    start = 0
    for off in offsets:
        end = start + off
        pos = start
        start = end

        def fl(p: int) -> int:
            return flags[p] if p < end else 0

        def cp(p: int) -> int:
            return cpts[p] if p < end else _OUT

        while pos < end:
            cpt = cpts[pos]
            f = flags[pos]
            n = _contraction(cpts, pos, end, fold=True)
            if n:
                out.append(n)
                pos += n
                continue
            first = pos
            # [^\r\n\p{L}\p{N}]?\p{L}+   (qwen35: [\p{L}\p{M}]+)
            if not (cpt == _CR or cpt == _LF or f & NUMBER) and (f & word_cls or fl(pos + 1) & word_cls):
                pos += 1
                while fl(pos) & word_cls:
                    pos += 1
                out.append(pos - first)
                continue
            # \p{N}{1,3}  or  \p{N}
            if f & NUMBER:
                if digits == 1:
                    out.append(1)
                    pos += 1
                    continue
                run = pos
                while fl(pos) & NUMBER:
                    pos += 1
                    if pos - run >= digits:
                        out.append(pos - run)
                        run = pos
                if pos > run:
                    out.append(pos - run)
                continue
            # ' ?[^\s\p{L}\p{N}]+[\r\n]*'  (llama.cpp tests the current codepoint's flags, not the next one's)
            f2 = fl(pos + 1) if cpt == _SPACE else f
            if not (f2 & not_punct) and f:
                pos += cpt == _SPACE
                while not (f2 & not_punct) and f2:
                    pos += 1
                    f2 = fl(pos)
                while cp(pos) == _CR or cp(pos) == _LF:
                    pos += 1
                out.append(pos - first)
                continue
            n_ws = 0
            last_rn = 0
            while fl(pos + n_ws) & WHITESPACE:
                c2 = cpts[pos + n_ws]
                if c2 == _CR or c2 == _LF:
                    last_rn = pos + n_ws + 1
                n_ws += 1
            if last_rn > 0:  # \s*[\r\n]+
                pos = last_rn
            elif n_ws > 1 and pos + n_ws < end:  # \s+(?!\S)
                pos += n_ws - 1
            elif n_ws > 0:  # \s+
                pos += n_ws
            else:
                pos += 1
            out.append(pos - first)
    return out


def split_llama3(cpts, flags, offsets):
    return _split_llama3_like(cpts, flags, offsets, digits=3, marks=False)


def split_qwen2(cpts, flags, offsets):
    return _split_llama3_like(cpts, flags, offsets, digits=1, marks=False)


def split_qwen35(cpts, flags, offsets):
    return _split_llama3_like(cpts, flags, offsets, digits=1, marks=True)


def split_newlines(cpts, flags, offsets):  # noqa: ARG001 - same signature as the other splitters
    """[^\\n]+|[\\n]+ : alternating runs of newlines and of everything else."""
    out: list[int] = []
    start = 0
    for off in offsets:
        end = start + off
        pos = start
        start = end
        while pos < end:
            nl = cpts[pos] == _LF
            run = pos
            while pos < end and (cpts[pos] == _LF) == nl:
                pos += 1
            out.append(pos - run)
    return out
