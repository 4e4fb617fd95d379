"""BPE pre-tokenization: `tokenizer.ggml.pre` -> the regex cascade of llama.cpp's llm_tokenizer_bpe.

llama.cpp splits text with a list of regexes, each one cutting the pieces left by the one before
(`unicode_regex_split`). The common patterns run hand-written splitters (splitters.py); the others run
std::regex on a "collapsed" text where each non-ASCII codepoint stands as one byte naming its class.
We do the same with Python's `re` (ASCII mode, like std::regex's \\s), so the words match exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from hybrid.errors import TokenizerError

from hybrid.text.tokenizer import splitters
from hybrid.text.tokenizer.unicode import ACCENT_MARK, LETTER, NUMBER, PUNCTUATION, SYMBOL, WHITESPACE, byte_encode, text_flags

GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_CONTR = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = _CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
QWEN2 = _CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
QWEN35 = (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
          "|\\s+(?!\\S)|\\s+")
NEWLINES = "[^\\n]+|[\\n]+"
_LLAMA3_ORIGINAL = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

# llama.cpp dispatches to a hand-written splitter when the regex string is exactly one of these.
CUSTOM_SPLITTERS = {
    GPT2: splitters.split_gpt2,
    LLAMA3: splitters.split_llama3,
    _LLAMA3_ORIGINAL: splitters.split_llama3,
    QWEN2: splitters.split_qwen2,
    QWEN35: splitters.split_qwen35,
    NEWLINES: splitters.split_newlines,
}

_DS3 = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+")


def _cased(letters: str, suffix: str) -> str:
    """The cased-word alternatives of the tekken / gpt-4o patterns (lookaheads stand for \\p{Lu} etc.)."""
    up = "((?=[" + letters + "])([^a-z]))"
    low = "((?=[" + letters + "])([^A-Z]))"
    head = "[^\\r\\n\\p{L}\\p{N}]?"
    return head + up + "*" + low + "+" + suffix + "|" + head + up + "+" + low + "*" + suffix


_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_TAIL = "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# Regex lists per pre-tokenizer kind, as llama.cpp's llm_tokenizer_bpe constructor lists them.
REGEXES: dict[str, tuple[str, ...]] = {
    "default": ("[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (LLAMA3,),
    "jais2": (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
              + "".join(f"|\\s{{{n}}}(?!\\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + "|\\s{1,2}(?!\\S)|\\s{1}",),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ),
    "deepseek3": ("\\p{N}{1,3}", _CJK_KANA, _DS3 + "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
    "spark2_5": ("\\p{N}{1,3}", _CJK_KANA, _DS3 + "|[\r\n]|\\s+(?!\\S)|\\s+", "\\p{N}"),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+" + _CONTR + "?"
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" + _CONTR + "?"
        "|\\p{N}" + _TAIL,
    ),
    "deepseek-coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}"),
    "falcon": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2, "[0-9][0-9][0-9]"),
    "starcoder": ("\\p{N}", GPT2),
    "gpt2": (GPT2,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "poro": (_PORO,),
    "viking": (_PORO, "\\p{N}"),
    "tekken": (_cased("\\p{L}", "") + "|\\p{N}" + _TAIL,),
    "chameleon": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
                  "[\\p{P}!-/:-@\\[-`{-~]", GPT2),
    "gpt4o": (_cased("\\p{L}", _CONTR + "?") + "|\\p{N}{1,3}" + _TAIL,),
    "granite-emb-multi": (_cased("\\p{L}\\p{M}", _CONTR + "?") + "|\\p{N}{1,3}" + _TAIL,),
    "superbpe": ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"),
    "bailingmoe": ("'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "seed-coder": (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+"
                   "|\\s+(?!\\S)|\\s+",),
    "ufakzeka": ("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "laguna": (NEWLINES, QWEN2),
    "exaone-moe": (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "gemma4": (NEWLINES,),
    "sarvam": (NEWLINES,),
    "minicpm5": ("\\p{N}{1,3}", _CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
}


@dataclass(frozen=True)
class PreSpec:
    """One `tokenizer.ggml.pre` value: its regex kind and the vocab flags llama.cpp sets with it."""

    kind: str
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool | None = None  # None: leave llama.cpp's default
    escape_whitespaces: bool = False
    byte_encode: bool = True
    bos_null: bool = False
    regexes: tuple[str, ...] = field(default=(), compare=False)


def _specs() -> dict[str, PreSpec]:
    s: dict[str, PreSpec] = {}

    def put(names: str, kind: str, **kw) -> None:
        for name in names.split():
            s[name] = PreSpec(kind, regexes=REGEXES[kind], **kw)

    keep_spaces = {"clean_spaces": False}
    put("default", "default")
    put("minicpm5", "minicpm5", ignore_merges=True)
    put("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", "llama3",
        ignore_merges=True, add_bos=True)
    put("deepseek-llm", "deepseek-llm", **keep_spaces)
    put("deepseek-coder", "deepseek-coder", **keep_spaces)
    put("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", "deepseek3", **keep_spaces)
    put("spark2_5", "spark2_5", **keep_spaces)
    put("youtu", "youtu", clean_spaces=False, ignore_merges=True)
    put("falcon", "falcon")
    put("mpt olmo jais gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4",
        "gpt2")
    put("jina-v1-en jina-v2-code roberta-bpe", "gpt2")
    put("trillion granite-docling", "gpt2", **keep_spaces)
    put("jais-2", "jais2")
    put("gemma4 granite-embed-multi-311m", "gemma4", escape_whitespaces=True, byte_encode=False)
    put("sarvam-moe", "sarvam", escape_whitespaces=True, byte_encode=False, clean_spaces=False)
    put("starcoder refact codeshell exaone minerva-7b mellum2", "starcoder")
    put("command-r smollm", "starcoder", **keep_spaces)
    put("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", "qwen2", **keep_spaces)
    put("stablelm2 megrez", "qwen2")
    put("grok-2", "qwen2", **keep_spaces)
    put("qwen35", "qwen35", **keep_spaces)
    put("dbrx smaug-bpe", "llama3")
    put("poro-chat", "poro", **keep_spaces)
    put("viking", "viking", **keep_spaces)
    put("bloom gpt3-finnish", "poro")
    put("chatglm-bpe", "llama3", bos_null=True)
    put("glm4 glm5", "llama3", bos_null=True, ignore_merges=True)
    put("tekken", "tekken", clean_spaces=False, ignore_merges=True, add_bos=True)
    put("chameleon", "chameleon", clean_spaces=False, add_bos=True)
    put("gpt-4o llama4 kanana2 talkie minimax-m2", "gpt4o", **keep_spaces)
    put("granite-embed-multi-97m", "granite-emb-multi", clean_spaces=False, ignore_merges=True)
    put("superbpe", "superbpe", **keep_spaces)
    put("bailingmoe bailingmoe2 llada-moe", "bailingmoe", **keep_spaces)
    put("seed-coder", "seed-coder", **keep_spaces)
    put("ufakzeka", "ufakzeka", **keep_spaces)
    put("laguna", "laguna", **keep_spaces)
    put("exaone-moe", "exaone-moe")
    return s


PRE_SPECS: dict[str, PreSpec] = _specs()
# Pre-tokenizers llama.cpp knows but that need splitters not written here.
UNSUPPORTED_PRE = ("kimi-k2", "afmoe", "tiny_aya", "cohere2moe", "whitespace")


def pre_spec(name: str) -> PreSpec:
    """The spec for a `tokenizer.ggml.pre` value ('' means llama.cpp's 'default')."""
    spec = PRE_SPECS.get(name or "default")
    if spec is None:
        why = "is not supported by hybrid yet" if name in UNSUPPORTED_PRE else "is unknown"
        raise TokenizerError(f"pre-tokenizer type '{name}' {why} (tokenizer.ggml.pre); known: {', '.join(sorted(PRE_SPECS))}")
    return spec


# The collapsed text (llama.cpp unicode_regex_split): ASCII stays, other codepoints become one byte per class.
_UCAT = {"\\p{N}": NUMBER, "\\p{L}": LETTER, "\\p{P}": PUNCTUATION, "\\p{M}": ACCENT_MARK, "\\p{S}": SYMBOL,
         "\\p{Lu}": LETTER, "\\p{Ll}": LETTER, "\\p{Lt}": LETTER, "\\p{Lm}": LETTER, "\\p{Lo}": LETTER}
_UCAT_CHAR = {NUMBER: "\xd1", LETTER: "\xd2", PUNCTUATION: "\xd3", ACCENT_MARK: "\xd4", SYMBOL: "\xd5"}
_UCAT_ASCII = {
    NUMBER: "0-9",
    LETTER: "A-Za-z",
    PUNCTUATION: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    ACCENT_MARK: "",
    SYMBOL: "\\$\\+<->^`\\|\\~",
}
_CATEGORY_MASK = 0xFF


def _collapse_char(cpt: int, flags: int) -> str:
    if cpt < 128:
        return chr(cpt)
    if flags & WHITESPACE:
        return "\x0b"  # std::regex's \s knows no non-ASCII spaces; llama.cpp substitutes a vertical tab
    return _UCAT_CHAR.get(flags & _CATEGORY_MASK, "\xd0")


def _collapse_regex(expr: str) -> str:
    """Rewrite \\p{..} classes to the collapsed bytes plus their ASCII members (llama.cpp's own scanner)."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append(ch)
            inside = True
        elif inside and ch == "]" and expr[i - 1] != "\\":
            out.append(ch)
            inside = False
        elif ch == "\\" and i + 3 < len(expr) and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            cat = _UCAT.get(expr[i : close + 1]) if close != -1 and close <= i + 10 else None
            if cat is None:
                out.append(ch)
            else:
                body = _UCAT_CHAR[cat] + _UCAT_ASCII[cat]
                out.append(body if inside else "[" + body + "]")
                i = close
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _ecmascript_to_python(expr: str) -> str:
    """ECMAScript `$` means end of input; Python's would also match before a final newline."""
    out: list[str] = []
    inside = escaped = False
    for ch in expr:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "[":
            inside = True
        elif ch == "]":
            inside = False
        elif ch == "$" and not inside:
            out.append("\\Z")
            continue
        out.append(ch)
    return "".join(out)


@lru_cache(maxsize=None)
def _compiled(expr: str) -> tuple[re.Pattern, bool]:
    collapsed = any(u in expr for u in _UCAT)
    if collapsed:
        if any(ord(c) >= 128 for c in expr):
            raise TokenizerError("regex mixes unicode categories and non-ASCII characters (llama.cpp refuses it too)")
        expr = _collapse_regex(expr)
    return re.compile(_ecmascript_to_python(expr), re.ASCII), collapsed


def _split_regex(pattern: re.Pattern, text: str, offsets: list[int]) -> list[int]:
    out: list[int] = []
    start = 0
    for off in offsets:
        sub = text[start : start + off]
        idx = 0
        for m in pattern.finditer(sub):
            s, e = m.span()
            if s > idx:
                out.append(s - idx)
            if e > s:
                out.append(e - s)
            idx = e
        if idx < off:
            out.append(off - idx)
        start += off
    return out


def split_words(text: str, spec: PreSpec) -> list[str]:
    """Split text into BPE words with spec's regex cascade; byte-level encoded when spec.byte_encode."""
    if not text:
        return []
    cpts = [ord(c) for c in text]
    flags = text_flags(cpts)
    offsets = [len(cpts)]
    collapsed_text = regex_text = None
    for expr in spec.regexes:
        custom = CUSTOM_SPLITTERS.get(expr)
        if custom is not None:
            offsets = custom(cpts, flags, offsets)
            continue
        pattern, use_collapsed = _compiled(expr)
        if use_collapsed:
            if collapsed_text is None:
                collapsed_text = "".join([_collapse_char(c, f) for c, f in zip(cpts, flags)])
            offsets = _split_regex(pattern, collapsed_text, offsets)
        else:
            if regex_text is None:
                regex_text = "".join(["\x0b" if c > 0x7F and f & WHITESPACE else chr(c) for c, f in zip(cpts, flags)])
            offsets = _split_regex(pattern, regex_text, offsets)
    words = []
    start = 0
    for off in offsets:
        words.append(text[start : start + off])
        start += off
    if spec.byte_encode:
        return [byte_encode(w) for w in words]
    return words
