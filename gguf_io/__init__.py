"""Reading GGUF model files: a validated memory-mapped reader, `ModelConfig`, and the quant registry."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .errors import GGUFFormatError, HybridError, UnsupportedArchitecture, UnsupportedQuantType
from .ggml_types import GGML_TYPE_IDS, GGML_TYPES, GGMLType
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
    "ModelConfig",
    "QUANTS",
    "QuantSpec",
    "SUPPORTED_ARCHITECTURES",
    "TensorInfo",
    "UnsupportedArchitecture",
    "UnsupportedQuantType",
    "open_gguf",
    "quant_spec",
]
