"""Loading an engine for a command: the model path, the cache directory, progress messages on stderr; and the
text a user gives (-p, -f, chat lines) made into valid text the same way everywhere."""

from __future__ import annotations

import sys

from hybrid.engine.engine import Engine
from hybrid.engine.launch import launch
from hybrid.engine.params import EngineParams
from hybrid.model.files import default_cache_dir, resolve_model

from hybrid.cli.common import cache_dir


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_engine(model: str | None, params: EngineParams, warn_ctx: bool = True) -> tuple[Engine, float]:
    """The engine for `model` (None: the demo model) and its load time in ms (hybrid.engine.launch). A context
    above the model's training context is said in one warning line (warn_ctx=False: not said)."""
    path = resolve_model(model, cache_dir())
    said: list[str] = []

    def progress(msg: str) -> None:
        said.append(msg)
        note(msg)

    engine, load_ms = launch(path, params, cache_dir() or default_cache_dir(), progress)
    n_ctx, n_train = engine.params.n_ctx, engine.config.n_ctx_train
    if warn_ctx and n_ctx > n_train > 0 and not any(m.startswith("warning: -c ") for m in said):
        note(f"warning: -c {n_ctx} is larger than the model's training context {n_train}")
    return engine, load_ms


def clean_text(text: str) -> str:
    """Text from the command line or a terminal with any undecodable bytes (Python keeps them as surrogates)
    replaced by U+FFFD, so it can be tokenized and printed."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def read_text_file(path: str) -> str:
    """A -f file as llama.cpp reads it (one trailing newline dropped). Bytes that are not UTF-8 are read as U+FFFD,
    with one warning line naming the first one's offset."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        note(f"warning: {path} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
             "such bytes are read as U+FFFD")
        text = raw.decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\n") else text
