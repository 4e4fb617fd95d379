"""The KV cache types the engine stores (-ctk/-ctv): gguf_io's one table, checked before any work."""

from __future__ import annotations

from gguf_io.kv_types import KV_TYPES, KVType, kv_row_bytes, kv_type

__all__ = ["KV_TYPES", "KVType", "check_kv_types", "kv_row_bytes", "kv_type"]


def check_kv_types(*names: str) -> tuple[str, ...]:
    """The names in the table's spelling; UnsupportedKVType (a one-line HybridError) for any other name."""
    return tuple(kv_type(n).name for n in names)
