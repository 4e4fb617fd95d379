"""Loading an engine for a command: model resolution, threads, -ngl handling, progress messages on stderr."""

from __future__ import annotations

import sys
import time

from hybrid.devices import probe_gpus
from hybrid.engine import Engine, EngineParams
from hybrid.models import resolve_model
from hybrid.threads import configure_threads

from .common import cache_dir


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_engine(model: str | None, params: EngineParams, ngl: str = "0") -> tuple[Engine, float]:
    """Returns the engine and its load time in ms. -ngl > 0 without a usable GPU says so and runs on the CPU."""
    path = resolve_model(model, cache_dir())
    if ngl not in ("0", "", None):
        gpus, why = probe_gpus()
        if not gpus:
            note(f"warning: -ngl {ngl} asked for GPU layers but no GPU is usable ({why}); running on the CPU")
    n_threads = configure_threads(params.n_threads)
    t0 = time.perf_counter()
    engine = Engine.load(path, EngineParams(params.n_ctx, params.n_batch, params.n_ubatch, params.type_k,
                                            params.type_v, n_threads), progress=note)
    return engine, 1000 * (time.perf_counter() - t0)
