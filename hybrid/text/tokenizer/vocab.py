"""GGUF tokenizer metadata -> a `Vocab`: token texts, scores, attributes, special ids, flags, the EOG set.

Follows llama.cpp's `llama_vocab::impl::load` (src/llama-vocab.cpp): the same defaults per tokenizer
model, the same flags per `tokenizer.ggml.pre`, the same text-based detection of EOT/FIM/EOG tokens.
Where llama.cpp walks a hash map (first match wins, in no defined order) we take the first text of its
candidate list that the vocab has (e.g. Llama 3's EOT is <|eot_id|>, not <|end_of_text|>).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybrid.errors import TokenizerError

from hybrid.text.tokenizer.pretokenize import PreSpec, pre_spec

NULL = -1  # LLAMA_TOKEN_NULL

# llama_token_attr bits (llama.h)
ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL = 0, 1 << 0, 1 << 1, 1 << 2
ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE, ATTR_NORMALIZED = 1 << 3, 1 << 4, 1 << 5, 1 << 6
ATTR_LSTRIP, ATTR_RSTRIP, ATTR_SINGLE_WORD = 1 << 7, 1 << 8, 1 << 9

# GGUF token types (llama_token_type) -> attributes; anything else is UNDEFINED.
TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED,
                5: ATTR_UNUSED, 6: ATTR_BYTE}

K = "tokenizer.ggml."
# (metadata key suffix, Vocab field) for the special token ids, in llama.cpp's order.
SPECIAL_ID_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"), ("eom_token_id", "eom"),
    ("unknown_token_id", "unk"), ("seperator_token_id", "sep"), ("padding_token_id", "pad"),
    ("mask_token_id", "mask"), ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
    ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"), ("fim_rep_token_id", "fim_rep"),
    ("fim_sep_token_id", "fim_sep"), ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"),
    ("middle_token_id", "fim_mid"),
)


@dataclass
class Vocab:
    """Everything the tokenizer sessions need, with llama.cpp's semantics (ids are NULL=-1 when absent)."""

    model: str  # tokenizer.ggml.model: "llama" (SPM) or "gpt2"/"gemma4" (BPE)
    kind: str  # "spm" or "bpe"
    pre: str
    spec: PreSpec | None  # BPE pre-tokenizer (None for SPM)
    tokens: list[str]
    scores: np.ndarray  # float32, one per token (a numpy array: 4 bytes a token, not a Python float's 32)
    attrs: list[int]
    token_types: np.ndarray  # int32, the GGUF token types as stored (NORMAL when the key is absent)
    token_to_id: dict[str, int]
    merges: list[str] = field(default_factory=list)
    bos: int = NULL
    eos: int = NULL
    eot: int = NULL
    eom: int = NULL
    unk: int = NULL
    sep: int = NULL
    pad: int = NULL
    mask: int = NULL
    fim_pre: int = NULL
    fim_suf: int = NULL
    fim_mid: int = NULL
    fim_pad: int = NULL
    fim_rep: int = NULL
    fim_sep: int = NULL
    add_space_prefix: bool = False
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False
    ignore_merges: bool = False
    clean_spaces: bool = False
    remove_extra_whitespaces: bool = False
    escape_whitespaces: bool = True
    eog_ids: set[int] = field(default_factory=set)
    special_tokens: list[int] = field(default_factory=list)  # CONTROL/USER_DEFINED/UNKNOWN, longest text first

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _array(metadata: dict, key: str, n: int, what: str):
    v = metadata.get(key)
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise TokenizerError(f"{key} should be an array of {what}, found {type(v).__name__}")
    if len(v) < n:
        raise TokenizerError(f"{key} has {len(v)} entries but tokenizer.ggml.tokens has {n}")
    return v


def _base(metadata: dict) -> Vocab:
    model = metadata.get(K + "model")
    if not isinstance(model, str):
        raise TokenizerError("the GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    pre_raw = metadata.get(K + "pre", "")
    pre = pre_raw if isinstance(pre_raw, str) else ""
    tokens = metadata.get(K + "tokens")
    if not isinstance(tokens, (list, tuple)) or not tokens or set(map(type, tokens)) != {str}:
        raise TokenizerError("tokenizer.ggml.tokens is missing or is not an array of strings")
    tokens = list(tokens)
    if "" in tokens:
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    n = len(tokens)
    scores_v = _array(metadata, K + "scores", n, "numbers")
    scores = np.zeros(n, np.float32) if scores_v is None else np.asarray(scores_v[:n], dtype=np.float32)
    types_v = _array(metadata, K + "token_type", n, "int32")
    types = np.ones(n, np.int32) if types_v is None else np.asarray(types_v[:n], dtype=np.int32)
    lut = np.array([TYPE_TO_ATTR[t] for t in range(len(TYPE_TO_ATTR))], np.int64)
    known = (types >= 0) & (types < len(lut))
    attrs = np.where(known, lut[np.where(known, types, 0)], ATTR_UNDEFINED).tolist()
    token_to_id = dict(zip(tokens, range(n)))
    if len(token_to_id) != n:
        raise TokenizerError(f"tokenizer.ggml.tokens holds {n - len(token_to_id)} duplicate token texts")
    common = dict(tokens=tokens, scores=scores, attrs=attrs, token_types=types, token_to_id=token_to_id)

    if model == "llama":
        v = Vocab(model, "spm", pre, None, bos=1, eos=2, unk=0, **common)
        v.add_space_prefix, v.add_bos = True, True
    elif model in ("gpt2", "gemma4"):
        merges = metadata.get(K + "merges")
        if not isinstance(merges, (list, tuple)):
            raise TokenizerError("tokenizer.ggml.merges is missing or is not an array of strings (needed for BPE)")
        if model == "gemma4":
            pre, bos, eos = "gemma4", NULL, NULL
        else:
            bos = eos = 11
        spec = pre_spec(pre)
        v = Vocab(model, "bpe", pre, spec, merges=list(merges), bos=bos, eos=eos, **common)
        v.escape_whitespaces = spec.escape_whitespaces
        v.clean_spaces = spec.clean_spaces
        v.ignore_merges = spec.ignore_merges
        if spec.add_bos is not None:
            v.add_bos = spec.add_bos
        if spec.bos_null:
            v.bos = NULL
    else:
        raise TokenizerError(f"tokenizer model '{model}' is not supported (supported: llama (SPM), gpt2 (BPE), gemma4)")
    v.add_space_prefix = bool(metadata.get(K + "add_space_prefix", v.add_space_prefix))
    v.remove_extra_whitespaces = bool(metadata.get(K + "remove_extra_whitespaces", False))
    return v


def _special_ids(v: Vocab, metadata: dict) -> None:
    n = v.n_tokens
    for key, name in SPECIAL_ID_KEYS:
        cur = getattr(v, name)
        if cur >= n:
            cur = NULL  # a default id out of range is disabled
        new = metadata.get(K + key)
        if isinstance(new, (int, np.integer)) and not isinstance(new, bool) and 0 <= int(new) < n:
            cur = int(new)
        setattr(v, name, cur)
    for key, name in (("add_bos_token", "add_bos"), ("add_eos_token", "add_eos"), ("add_sep_token", "add_sep")):
        if K + key in metadata:
            setattr(v, name, bool(metadata[K + key]))
    if v.spec is not None and v.spec.kind == "gemma4" and not v.add_bos:
        v.add_bos = True  # llama.cpp's Gemma 4 workaround


# Token texts llama.cpp recognizes (llama_vocab::impl::load), by role.
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
             "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


def _ids_of(v: Vocab, texts) -> list[int]:
    """Ids of the given texts present in the vocab, in id order."""
    return sorted(v.token_to_id[t] for t in set(texts) if t in v.token_to_id)


def _ids_with(v: Vocab, mask: int) -> list[int]:
    """Ids whose attributes have any bit of mask, in id order."""
    return np.flatnonzero(np.array(v.attrs, np.int64) & mask).tolist()


def _mark_control(v: Vocab, tid: int) -> None:
    v.attrs[tid] |= ATTR_CONTROL  # llama.cpp: "control-looking token ... its type will be overridden"


def _detect_by_text(v: Vocab) -> None:
    """EOT, EOM and FIM tokens found by their text when the metadata does not name them."""
    for name, texts in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS), *FIM_TEXTS.items()):
        if getattr(v, name) != NULL:
            continue
        tid = next((v.token_to_id[t] for t in texts if t in v.token_to_id), None)
        if tid is not None:
            setattr(v, name, tid)
            _mark_control(v, tid)
    # control tokens with "unused" in their text are unused
    for i in _ids_with(v, ATTR_CONTROL):
        if "unused" in v.tokens[i]:
            v.attrs[i] |= ATTR_UNUSED


def _eog(v: Vocab) -> None:
    eog = {t for t in (v.fim_pad, v.fim_rep, v.fim_sep) if t != NULL}
    for tid in _ids_of(v, EOG_TEXTS):
        eog.add(tid)
        _mark_control(v, tid)
    for tid in _ids_of(v, ALWAYS_RENDERED):
        v.attrs[tid] = ATTR_USER_DEFINED
    eog.update(t for t in (v.eos, v.eot, v.eom) if t != NULL)
    texts = {v.tokens[t]: t for t in sorted(eog) if 0 <= t < v.n_tokens}
    # o200k_harmony / solar-open: "<|end|>" is not an end of generation when these are present
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
        v.attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 and plamo have a normal </s> token
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        v.attrs[texts["</s>"]] = ATTR_NORMAL
    v.eog_ids = eog


def _special_cache(v: Vocab) -> None:
    # llama.cpp sorts by byte length with std::sort (ties in no defined order); ties here go by id.
    ids = _ids_with(v, ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)
    ids.sort(key=lambda i: -len(v.tokens[i].encode("utf-8", "surrogateescape")))
    v.special_tokens = ids


def _model_attrs(v: Vocab, metadata: dict) -> None:
    """Per-model LSTRIP/RSTRIP attributes llama.cpp sets by model, tokenizer or architecture name."""
    name = str(metadata.get("general.name", "")).encode("utf-8", "surrogateescape").lower()
    pre = str(metadata.get(K + "pre", ""))
    arch = str(metadata.get("general.architecture", ""))

    def setattr_text(text: str, attr: int, on: bool) -> None:
        tid = v.token_to_id.get(text)
        if tid is not None:
            v.attrs[tid] = v.attrs[tid] | attr if on else v.attrs[tid] & ~attr

    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        setattr_text("<mask>", ATTR_LSTRIP, True)
    elif b"phi-3" in name or b"phi3" in name:
        for tid in v.special_tokens:
            v.attrs[tid] |= ATTR_RSTRIP
        setattr_text("</s>", ATTR_RSTRIP, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            setattr_text(text, ATTR_RSTRIP, False)
    elif b"modern-bert" in name:
        setattr_text("[MASK]", ATTR_LSTRIP, True)


def load_vocab(metadata: dict) -> Vocab:
    """Build the vocab from GGUF metadata (GGUFFile.metadata shape); raises TokenizerError."""
    v = _base(metadata)
    _special_ids(v, metadata)
    _detect_by_text(v)
    _eog(v)
    _special_cache(v)
    _model_attrs(v, metadata)
    return v
