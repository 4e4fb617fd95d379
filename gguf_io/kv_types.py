"""The KV cache types, one table: llama.cpp's --cache-type-k/-v names, the kernels' codes, ggml's block sizes.

`code` is the number kernels_cpu and kernels_gpu (kv.cu, attention.cu) branch on; it is not a GGML type id.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedKVType
from .ggml_types import GGML_TYPE_IDS, GGML_TYPES


@dataclass(frozen=True)
class KVType:
    """One KV cache type: rows of head_dim values are stored as head_dim // block blocks of block_bytes."""

    name: str  # as -ctk/-ctv spell it
    code: int  # the kernels' switch value
    block: int  # elements per block (ggml's blck_size)
    block_bytes: int  # bytes per block (ggml's type_size)


def _entry(name: str, code: int) -> KVType:
    ggml = GGML_TYPES[GGML_TYPE_IDS[name.upper()]]  # block_q8_0: d, qs[32]; block_q4_0: d, qs[16]
    return KVType(name, code, ggml.block_size, ggml.type_size)


# In the order user messages list them (f16 is the default); bf16 is not here: the kernels do not store it.
KV_TYPES: dict[str, KVType] = {t.name: t for t in (_entry("f16", 1), _entry("q8_0", 2), _entry("q4_0", 3),
                                                   _entry("f32", 0))}


def kv_type(name: str) -> KVType:
    """The KV cache type called `name` (any case); UnsupportedKVType (a ValueError) for any other name."""
    t = KV_TYPES.get(str(name).lower())
    if t is None:
        raise UnsupportedKVType(f"KV cache type must be one of {', '.join(KV_TYPES)}, found {name!r}")
    return t


def kv_row_bytes(name: str, head_dim: int) -> int:
    """Bytes of one head's row of head_dim values; UnsupportedKVType unless the type's block divides head_dim."""
    t = kv_type(name)
    if head_dim % t.block:
        raise UnsupportedKVType(f"a {t.name} KV cache needs a head size divisible by {t.block}, found {head_dim}")
    return head_dim // t.block * t.block_bytes
