"""Starting an engine the way every front end does (the CLI today, the server next): -ngl resolved against the
GPUs there are (`auto` measured as `hybrid probe` does), worker threads pinned one per physical core, the
kernels compiled once on a first run, then `Engine.load`. Progress lines go to a callback; nothing is printed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gguf_io import ModelConfig, open_gguf

from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams
from hybrid.system.devices import probe_gpus
from hybrid.system.threads import kernel_cache_stale, mark_kernels_compiled, setup_threads

Progress = Callable[[str], None]


def resolve_gpu_layers(path: Path, params: EngineParams, progress: Progress) -> EngineParams:
    """params with -ngl made concrete: 0 when no GPU is usable (said as a warning), `auto` -> the probe's
    recommendation (prediction, a measured check, 1 GiB of headroom); numbers and `all` as given."""
    ngl = params.n_gpu_layers
    if ngl == 0:
        return params
    gpus, why = probe_gpus()
    if not gpus:
        progress(f"warning: -ngl {ngl} asked for GPU layers but no GPU is usable ({why}); running on the CPU")
        return replace(params, n_gpu_layers=0)
    if ngl != "auto":
        return params
    from hybrid.engine.fit import choose_ngl  # noqa: PLC0415 - CuPy
    from hybrid.plan.probe import DEFAULT_MARGIN_BYTES  # noqa: PLC0415

    n_ctx = params.n_ctx
    if not n_ctx:
        with open_gguf(path) as f:
            n_ctx = ModelConfig.from_gguf(f).n_ctx_train
    budget = params.vram_budget if params.vram_budget is not None else gpus[0].free_bytes
    found = choose_ngl(path, replace(params, n_ctx=n_ctx), budget, DEFAULT_MARGIN_BYTES)
    chosen = found.recommendation.ngl
    progress(f"-ngl auto: predicted {found.prediction.ngl}, measured ceiling {found.ceiling} "
             f"({len(found.attempts)} attempts, {found.seconds} s), using -ngl {chosen} (1 GiB of headroom)")
    return replace(params, n_gpu_layers=chosen)


def launch(path: Path, params: EngineParams, marker_dir: Path, progress: Progress) -> tuple[Engine, float]:
    """The engine and its load time in ms. Numba's workers are pinned one per physical core (params.cpus
    narrows the CPUs, params.numa orders them); when the kernels' compile cache (marked in marker_dir) is stale,
    one line says so and the kernels are compiled here (counted in the load time), right after the message."""
    params = resolve_gpu_layers(path, params, progress)
    threads = setup_threads(params.n_threads, params.cpus, params.numa)
    compile_first = kernel_cache_stale(marker_dir)
    verbose = params.n_gpu_layers != 0 or params.use_mlock or bool(params.numa)
    t0 = time.perf_counter()
    engine = Engine.load(path, replace(params, n_threads=threads.n_threads), progress=progress if verbose else None)
    if compile_first:  # said once the model opened, so a bad file gets its one-line error alone
        progress("compiling kernels (first run only) …")
        engine.warmup()
        mark_kernels_compiled(marker_dir)
    return engine, 1000 * (time.perf_counter() - t0)
