"""Starting an engine the way every front end does (the CLI today, the server next): -ngl resolved against the
GPUs there are (`auto` measured as `hybrid probe` does), -ub auto made concrete, `Engine.load`, and within it, once
the layers are placed, the kernels the CPU's share calls compiled ahead on a first run (in parallel) and the worker
threads pinned one per physical core. Progress goes to callbacks; nothing is printed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gguf_io import ModelConfig, open_gguf
from kernels_cpu.signatures import closure

from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams
from hybrid.errors import PlacementError
from hybrid.system.devices import probe_gpus
from hybrid.system.compile import (CompilePool, CompileStatus, compile_kernels, kernel_cache_stale,
                                   load_cpu_target, mark_kernels_compiled, uncached)
from hybrid.system.threads import PIN_KERNEL, physical_cores, setup_threads

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
    with open_gguf(path) as f:
        moe_model = ModelConfig.from_gguf(f).n_expert > 0
    if moe_model and not params.overrides:  # every layer on the GPU, the experts of the first N in RAM
        from hybrid.engine.fit import choose_n_cpu_moe  # noqa: PLC0415
        from hybrid.plan.overrides import cpu_moe_overrides  # noqa: PLC0415

        moe = choose_n_cpu_moe(path, replace(params, n_ctx=n_ctx), budget, DEFAULT_MARGIN_BYTES)
        if moe.fits:
            progress(f"-ngl auto: an MoE model; predicted --n-cpu-moe {moe.predicted}, measured {moe.measured} "
                     f"({len(moe.attempts)} attempts, {moe.seconds} s), using -ngl all --n-cpu-moe {moe.recommended} "
                     f"(1 GiB of headroom)")
            return replace(params, n_gpu_layers="all", overrides=cpu_moe_overrides(n_cpu_moe=moe.recommended))
    found = choose_ngl(path, replace(params, n_ctx=n_ctx), budget, DEFAULT_MARGIN_BYTES)
    chosen = found.recommendation.ngl
    progress(f"-ngl auto: predicted {found.prediction.ngl}, measured ceiling {found.ceiling} "
             f"({len(found.attempts)} attempts, {found.seconds} s), using -ngl {chosen} (1 GiB of headroom)")
    return replace(params, n_gpu_layers=chosen)


AUTO_UBATCH_SMALL = 512  # -ub auto where some layer stays on the CPU or the larger buffers do not fit


def resolve_ubatch(path: Path, params: EngineParams, progress: Progress) -> EngineParams:
    """params with -ub auto (n_ubatch None, `hybrid serve`'s default) made concrete: the whole -b where every layer
    and the output sit on the GPU, no tensor overridden to the CPU, and the plan with micro-batches of -b tokens
    still fits the VRAM with the probe's 1 GiB of headroom; else AUTO_UBATCH_SMALL (llama.cpp's 512). The GPU
    prefill dequantizes every weight once a micro-batch for cuBLAS, so a wave of prompts in one micro-batch of
    2048 costs an 8B model ~0.6x of four of 512; the price is the FFN's larger buffers (~350 MB at 2048)."""
    if params.n_ubatch is not None:
        return params
    small = replace(params, n_ubatch=min(AUTO_UBATCH_SMALL, params.n_batch))
    if params.n_gpu_layers == 0 or params.overrides or params.n_batch <= small.n_ubatch:
        return small
    from hybrid.plan.budget import plan_for  # noqa: PLC0415
    from hybrid.plan.probe import DEFAULT_MARGIN_BYTES  # noqa: PLC0415

    gpus, _ = probe_gpus()
    if not gpus:
        return small
    big = replace(params, n_ubatch=params.n_batch)
    budget = params.vram_budget if params.vram_budget is not None else gpus[0].free_bytes
    with open_gguf(path) as f:
        config = ModelConfig.from_gguf(f)
        inputs = big.plan_inputs(params.n_ctx or config.n_ctx_train)
        try:
            plan = plan_for(config, f.tensors, max(0, budget - DEFAULT_MARGIN_BYTES), big.n_gpu_layers, inputs)
        except PlacementError:  # not with micro-batches that large (the load says so for the flags as given)
            return small
    if plan.n_gpu_layers >= config.n_layer + 1 and plan.max_fit_ngl >= config.n_layer + 1:
        progress(f"-ub auto: {big.n_ubatch} (every layer on the GPU, with room for micro-batches of -b tokens)")
        return big
    return small


def launch(path: Path, params: EngineParams, marker_dir: Path, progress: Progress,
           on_compile: Callable[[CompileStatus], None] | None = None) -> tuple[Engine, float]:
    """The engine and its load time in ms. When kernels this model calls on the CPU are not in the compile cache
    (or the cache is stale: marked in marker_dir), one line says so once the model opened (a bad file gets its
    one-line error alone), they are compiled over the cores, and the engine is warmed up, all counted in the load
    time; on_compile hears how far the compile got. On a first run (no marker) the compiling processes start
    before the model opens. Then Numba's workers are pinned one per physical core (params.cpus narrows the CPUs,
    params.numa orders them), before the CPU layers are repacked."""
    params = resolve_ubatch(path, resolve_gpu_layers(path, params, progress), progress)
    t0 = time.perf_counter()
    stale = kernel_cache_stale(marker_dir)
    verbose = params.n_gpu_layers != 0 or params.use_mlock or bool(params.numa)
    n = compile_workers(params.cpus)
    pool = CompilePool(n, params.cpus) if stale and n > 1 else None  # its workers import while the model opens
    if pool is not None:
        load_cpu_target()
    compiled: list[bool] = []

    def placed(engine: Engine) -> None:  # every layer has its backend; the repack comes next
        todo = uncached([PIN_KERNEL, *closure(engine.cpu_kernels())])
        if todo or stale:
            progress(f"compiling kernels (first run only): {len(todo)} for this model, {n} at a time …" if todo
                     else "compiling kernels (first run only) …")
            if pool is not None:
                pool.compile(todo, on_compile)
            else:
                compile_kernels(todo, n, on_compile, params.cpus)
            compiled.append(True)
        if pool is not None:
            pool.close()
        threads = setup_threads(params.n_threads, params.cpus, params.numa)
        engine.params = replace(engine.params, n_threads=threads.n_threads)

    try:
        engine = Engine.load(path, params, progress=progress if verbose else None, on_placed=placed)
    finally:
        if pool is not None:
            pool.close()
    if compiled:
        engine.warmup()  # loads what was compiled ahead; compiles anything the list above does not hold
        mark_kernels_compiled(marker_dir)
    return engine, 1000 * (time.perf_counter() - t0)


def compile_workers(cpus=()) -> int:
    """Processes that compile kernels side by side: one per physical core this process may use (of params.cpus)."""
    return len(physical_cores(cpus or None))
