"""One mapping from exception type to a one-line message; HYBRID_DEBUG=1 shows the traceback instead."""

from __future__ import annotations

import os
from pathlib import Path

from hybrid import errors as E

# Most specific first; the label tells the user which kind of problem it is.
ERROR_LABELS: tuple[tuple[type[BaseException], str], ...] = (
    (E.GGUFFormatError, "invalid GGUF file"),
    (E.UnsupportedArchitecture, "unsupported architecture"),
    (E.UnsupportedKVType, "unsupported KV cache type"),
    (E.UnsupportedQuantType, "unsupported quant type"),
    (E.ModelNotFound, "model not found"),
    (E.UnsupportedPlacement, "unsupported placement"),
    (E.PlacementError, "does not fit"),
    (E.DeviceUnavailable, "no usable GPU"),
    (E.MemlockError, "mlock refused"),
    (E.ContextTooLarge, "context"),
    (E.TokenizerError, "tokenizer"),
    (E.HybridError, "error"),
    (MemoryError, "out of memory"),
    (PermissionError, "permission denied"),
    (FileNotFoundError, "file not found"),
    (IsADirectoryError, "is a directory"),
    (OSError, "I/O error"),
)
CACHE_DIR_LABEL = "cache directory"
CACHE_DIR_HINT = "(set HYBRID_CACHE_DIR to a writable directory)"


def _cache_dir() -> Path:
    env = os.environ.get("HYBRID_CACHE_DIR")
    if env:
        return Path(env)
    from hybrid.model.files import default_cache_dir  # noqa: PLC0415 - only for this one message

    return default_cache_dir()


def _in_cache_dir(exc: BaseException) -> bool:
    """An OSError on the cache directory (or a path in it), or a model that could not be written there: a problem
    of the place models are kept, not of the model the user named."""
    if isinstance(exc, E.ModelNotFound):
        return isinstance(exc.__context__, OSError)  # raised while handling a failed write
    if not isinstance(exc, OSError) or not exc.filename:
        return False
    try:
        cache = _cache_dir().expanduser().absolute()
        path = Path(os.fsdecode(exc.filename)).expanduser().absolute()
    except (TypeError, ValueError, RuntimeError):
        return False
    return path == cache or cache in path.parents


def one_line(exc: BaseException) -> str:
    """`error: <label>: <first line of the message>` for any exception."""
    label = next((lbl for typ, lbl in ERROR_LABELS if isinstance(exc, typ)), "internal error")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if label == "internal error":
        text = f"{type(exc).__name__}: {text} (set HYBRID_DEBUG=1 for the traceback)"
    elif _in_cache_dir(exc):
        label, text = CACHE_DIR_LABEL, f"{text} {CACHE_DIR_HINT}"
    return f"error: {text}" if label == "error" else f"error: {label}: {text}"
