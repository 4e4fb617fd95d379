"""Every error hybrid reports as a one-line message (the CLI maps each type to its message)."""

from gguf_io.errors import GGUFFormatError, HybridError, UnsupportedArchitecture, UnsupportedKVType, UnsupportedQuantType


class ModelNotFound(HybridError):
    """No model file was given and the demo model is not installed, or the path does not exist."""


class PlacementError(HybridError):
    """The requested layers, KV cache and buffers do not fit the VRAM budget."""


class UnsupportedPlacement(PlacementError):
    """A placement hybrid cannot carry out (an -ot override that splits what it keeps together)."""


class DeviceUnavailable(HybridError):
    """A GPU was asked for but no usable CuPy device exists."""


class MemlockError(HybridError):
    """mlock was refused (RLIMIT_MEMLOCK too low)."""


class ContextTooLarge(HybridError):
    """The requested context does not fit the model or the memory budget."""


class TokenizerError(HybridError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


__all__ = [
    "HybridError",
    "GGUFFormatError",
    "UnsupportedArchitecture",
    "UnsupportedQuantType",
    "UnsupportedKVType",
    "ModelNotFound",
    "PlacementError",
    "UnsupportedPlacement",
    "DeviceUnavailable",
    "MemlockError",
    "ContextTooLarge",
    "TokenizerError",
]
