"""Loading an engine for a command: model resolution, threads, -ngl handling, progress messages on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import typer

from hybrid.devices import probe_gpus
from hybrid.engine import Engine, EngineParams
from hybrid.models import resolve_model
from hybrid.sizes import parse_size
from hybrid.threads import configure_threads

from .common import cache_dir


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_engine(model: str | None, params: EngineParams, ngl: str = "0",
                vram_budget: str | None = None) -> tuple[Engine, float]:
    """Returns the engine and its load time in ms. -ngl > 0 without a usable GPU says so and runs on the CPU."""
    path = resolve_model(model, cache_dir())
    ngl = str(ngl).strip().lower() or "0"
    if ngl != "auto" and ngl != "all" and not ngl.isdigit():
        raise typer.BadParameter(f"-ngl takes a number, 'auto' or 'all', got '{ngl}'")
    if ngl != "0":
        gpus, why = probe_gpus()
        if not gpus:
            note(f"warning: -ngl {ngl} asked for GPU layers but no GPU is usable ({why}); running on the CPU")
            ngl = "0"
    budget = parse_size(vram_budget) if vram_budget else None
    n_threads = configure_threads(params.n_threads)
    t0 = time.perf_counter()
    engine = Engine.load(path, replace(params, n_threads=n_threads, n_gpu_layers=ngl, vram_budget=budget),
                         progress=note if ngl != "0" else None)
    return engine, 1000 * (time.perf_counter() - t0)
