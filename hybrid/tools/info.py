"""A summary of a GGUF model for `hybrid info`: hyperparameters, sizes, tensors by type, bytes per layer."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass

from gguf_io import GGUFFile, ModelConfig

_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TypeStats:
    type_name: str
    n_tensors: int
    n_bytes: int


@dataclass(frozen=True)
class ModelSummary:
    path: str
    file_size: int
    gguf_version: int
    architecture: str
    name: str
    n_params: int
    config: ModelConfig | None
    config_error: str
    types: tuple[TypeStats, ...]
    layer_bytes: tuple[int, ...]  # weight bytes of blk.{i}.*
    other_bytes: dict[str, int]  # non-layer tensors by name (token_embd, output, output_norm, ...)
    has_chat_template: bool
    tokenizer_model: str
    n_vocab_tokens: int

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["types"] = [dataclasses.asdict(t) for t in self.types]
        return d


def summarize(f: GGUFFile) -> ModelSummary:
    """Collect everything `hybrid info` shows from an open GGUF file."""
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    layers: dict[int, int] = defaultdict(int)
    other: dict[str, int] = {}
    for t in f.tensors.values():
        stats = by_type[t.type_name]
        stats[0] += 1
        stats[1] += t.nbytes
        m = _LAYER.match(t.name)
        if m:
            layers[int(m.group(1))] += t.nbytes
        else:
            other[t.name] = t.nbytes
    try:
        config, config_error = ModelConfig.from_gguf(f), ""
    except Exception as exc:  # noqa: BLE001 - info still shows what it can; the reason is reported
        config, config_error = None, str(exc)
    n_layers = max(layers) + 1 if layers else 0
    tokens = f.metadata.get("tokenizer.ggml.tokens") or []
    return ModelSummary(
        path=str(f.path),
        file_size=f.file_size,
        gguf_version=f.version,
        architecture=str(f.metadata.get("general.architecture", "unknown")),
        name=str(f.metadata.get("general.name", "")),
        n_params=sum(t.n_elements for t in f.tensors.values()),
        config=config,
        config_error=config_error,
        types=tuple(
            TypeStats(name, n, b) for name, (n, b) in sorted(by_type.items(), key=lambda kv: -kv[1][1])
        ),
        layer_bytes=tuple(layers.get(i, 0) for i in range(n_layers)),
        other_bytes=other,
        has_chat_template="tokenizer.chat_template" in f.metadata,
        tokenizer_model=str(f.metadata.get("tokenizer.ggml.model", "")),
        n_vocab_tokens=len(tokens),
    )


# llama.cpp's llama_model_ftype_name for general.file_type
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 22: "IQ3_XS", 23: "IQ3_XXS",
    24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_S mix", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
    32: "BF16", 38: "MXFP4 MoE",
}


def size_label(n_params: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n_params >= div:
            return f"{n_params / div:.0f}{unit}" if n_params / div >= 10 else f"{n_params / div:.1f}{unit}"
    return str(n_params)


def model_type(f: GGUFFile) -> str:
    """llama-bench's model_type, e.g. 'gemma3 270M Q4_K - Medium'."""
    arch = str(f.metadata.get("general.architecture", "?"))
    label = f.metadata.get("general.size_label") or size_label(f.n_params)
    ftype = f.metadata.get("general.file_type")
    return f"{arch} {label} {FTYPE_NAMES.get(ftype, f'ftype {ftype}')}"
