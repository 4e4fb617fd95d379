"""Loading an engine for a command: the model path, the cache directory, progress messages on stderr."""

from __future__ import annotations

import sys

from hybrid.engine.engine import Engine
from hybrid.engine.launch import launch
from hybrid.engine.params import EngineParams
from hybrid.model.files import default_cache_dir, resolve_model

from hybrid.cli.common import cache_dir


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_engine(model: str | None, params: EngineParams) -> tuple[Engine, float]:
    """The engine for `model` (None: the demo model) and its load time in ms (hybrid.engine.launch)."""
    path = resolve_model(model, cache_dir())
    return launch(path, params, cache_dir() or default_cache_dir(), note)
