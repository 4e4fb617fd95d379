"""The error hierarchy's root and the errors raised while reading a model file.

`gguf_io` is the lowest layer, so the base class lives here; `hybrid.errors` re-exports
these and adds the errors of the higher layers.
"""


class HybridError(Exception):
    """Base of every error hybrid reports to the user as a one-line message."""


class GGUFFormatError(HybridError):
    """The file is not a valid GGUF: the message says what was expected and what was found."""


class UnsupportedArchitecture(HybridError):
    """`general.architecture` names an architecture hybrid cannot run."""


class UnsupportedQuantType(HybridError):
    """A tensor uses a GGML type that has no entry in the quant registry (or no kernel)."""


class UnsupportedKVType(UnsupportedQuantType, ValueError):
    """A KV cache type outside `gguf_io.kv_types.KV_TYPES`, or a head size its blocks do not divide.

    Also a ValueError: the kernels' callers have always caught the KV checks as one.
    """
