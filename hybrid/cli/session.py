"""Loading an engine for a command: model resolution, threads (count, pinning, CPUs), --numa/--mlock/--no-mmap,
-ngl handling, the first-run compile message, progress messages on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import typer

from gguf_io import ModelConfig, open_gguf
from hybrid.system.devices import probe_gpus
from hybrid.engine.engine import Engine, EngineParams
from hybrid.errors import HybridError
from hybrid.model.files import default_cache_dir, resolve_model
from hybrid.system.numa import check_mode as check_numa_mode
from hybrid.system.sizes import parse_size
from hybrid.system.threads import kernel_cache_stale, mark_kernels_compiled, select_cpus, setup_threads

from hybrid.cli.common import cache_dir


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def system_params(numa: str | None, mlock: bool, no_mmap: bool, cpu_mask: str | None,
                  cpu_range: str | None, no_op_offload: bool = False, no_repack: bool = False) -> dict:
    """The EngineParams fields of --numa, --mlock, --no-mmap, -C/--cpu-mask, --cpu-range, --no-op-offload and
    --no-repack (usage errors raised)."""
    try:
        return {"numa": check_numa_mode(numa or ""), "use_mlock": mlock, "use_mmap": not no_mmap,
                "cpus": select_cpus(cpu_mask, cpu_range), "op_offload": not no_op_offload, "repack": not no_repack}
    except HybridError as exc:
        raise typer.BadParameter(str(exc)) from None


def load_engine(model: str | None, params: EngineParams, ngl: str = "0",
                vram_budget: str | None = None) -> tuple[Engine, float]:
    """Returns the engine and its load time in ms. -ngl > 0 without a usable GPU says so and runs on the CPU.

    Numba's workers are pinned one per physical core (params.cpus narrows the CPUs, params.numa orders them);
    when the kernels' compile cache is empty, one line says so and the kernels are compiled here (counted in
    the load time) so the pause comes right after the message."""
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
    if ngl == "auto":  # the probe's machinery: prediction, then a measured check, keeping 1 GiB of headroom
        from hybrid.plan.probe import DEFAULT_MARGIN_BYTES  # noqa: PLC0415
        from hybrid.engine.fit import choose_ngl  # noqa: PLC0415 - CuPy

        n_ctx = params.n_ctx
        if not n_ctx:
            with open_gguf(path) as f:
                n_ctx = ModelConfig.from_gguf(f).n_ctx_train
        found = choose_ngl(path, replace(params, n_ctx=n_ctx), budget if budget is not None else gpus[0].free_bytes,
                           DEFAULT_MARGIN_BYTES)
        chosen = found.recommendation.ngl
        note(f"-ngl auto: predicted {found.prediction.ngl}, measured ceiling {found.ceiling} "
             f"({len(found.attempts)} attempts, {found.seconds} s), using -ngl {chosen} (1 GiB of headroom)")
        ngl = str(chosen)
    threads = setup_threads(params.n_threads, params.cpus, params.numa)
    marker_dir = cache_dir() or default_cache_dir()
    compile_first = kernel_cache_stale(marker_dir)
    verbose = ngl != "0" or params.use_mlock or bool(params.numa)
    t0 = time.perf_counter()
    engine = Engine.load(path, replace(params, n_threads=threads.n_threads, n_gpu_layers=ngl, vram_budget=budget),
                         progress=note if verbose else None)
    if compile_first:  # said once the model opened, so a bad file gets its one-line error alone
        note("compiling kernels (first run only) …")
        engine.warmup()
        mark_kernels_compiled(marker_dir)
    return engine, 1000 * (time.perf_counter() - t0)
