"""Reading GGUF model files: a validated memory-mapped reader, `ModelConfig`, the quant registry, the KV cache types."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .errors import GGUFFormatError, HybridError, UnsupportedArchitecture, UnsupportedKVType, UnsupportedQuantType
from .ggml_types import GGML_TYPE_IDS, GGML_TYPES, GGMLType
from .kv_types import KV_TYPES, KVType, kv_row_bytes, kv_type
from .quants import QUANTS, QuantSpec, quant_spec
from .reader import GGUFFile, TensorInfo, open_gguf

# `gguf_io.open(path)`, as in the contract; left out of __all__ so `import *` never shadows the builtin.
open = open_gguf  # noqa: A001

__all__ = [
    "GGML_TYPES",
    "GGML_TYPE_IDS",
    "GGMLType",
    "GGUFFile",
    "GGUFFormatError",
    "HybridError",
    "KV_TYPES",
    "KVType",
    "ModelConfig",
    "QUANTS",
    "QuantSpec",
    "SUPPORTED_ARCHITECTURES",
    "TensorInfo",
    "UnsupportedArchitecture",
    "UnsupportedKVType",
    "UnsupportedQuantType",
    "kv_row_bytes",
    "kv_type",
    "open_gguf",
    "quant_spec",
]
