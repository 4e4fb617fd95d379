"""One mapping from exception type to a one-line message; HYBRID_DEBUG=1 shows the traceback instead."""

from __future__ import annotations

from hybrid import errors as E

# Most specific first; the label tells the user which kind of problem it is.
ERROR_LABELS: tuple[tuple[type[BaseException], str], ...] = (
    (E.GGUFFormatError, "invalid GGUF file"),
    (E.UnsupportedArchitecture, "unsupported architecture"),
    (E.UnsupportedKVType, "unsupported KV cache type"),
    (E.UnsupportedQuantType, "unsupported quant type"),
    (E.ModelNotFound, "model not found"),
    (E.PlacementError, "does not fit"),
    (E.DeviceUnavailable, "no usable GPU"),
    (E.MemlockError, "mlock refused"),
    (E.ContextTooLarge, "context too large"),
    (E.TokenizerError, "tokenizer"),
    (E.HybridError, "error"),
    (MemoryError, "out of memory"),
    (PermissionError, "permission denied"),
    (FileNotFoundError, "file not found"),
    (IsADirectoryError, "is a directory"),
    (OSError, "I/O error"),
)


def one_line(exc: BaseException) -> str:
    """`error: <label>: <first line of the message>` for any exception."""
    label = next((lbl for typ, lbl in ERROR_LABELS if isinstance(exc, typ)), "internal error")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if label == "internal error":
        text = f"{type(exc).__name__}: {text} (set HYBRID_DEBUG=1 for the traceback)"
    return f"error: {text}" if label == "error" else f"error: {label}: {text}"
