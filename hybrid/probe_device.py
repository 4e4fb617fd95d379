"""The measured half of `hybrid probe`: really allocate a candidate -ngl's GPU weights (placeholder bytes of the
real sizes: no upload of the real weights), KV cache and compute buffers, run one prefill micro-batch and one
decode step through the GPU layers, catch the out-of-memory error, and free everything."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .engine import Engine, EngineParams
from .errors import PlacementError


@dataclass(frozen=True)
class FitAttempt:
    ngl: int
    fits: bool
    peak_bytes: int  # the memory pool's peak during the attempt
    error: str = ""


def _is_oom(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("OutOfMemoryError", "MemoryError") or "out of memory" in str(exc).lower()


def try_fit(path, params: EngineParams, ngl: int, budget_bytes: int) -> FitAttempt:
    """Load `ngl` layers with placeholder weights under a memory pool capped at budget_bytes (the plan's own check
    is lifted so the device decides), run a micro-batch of -ub tokens and one decode step on the GPU layers."""
    import cupy  # noqa: PLC0415 - only with a GPU

    pool = cupy.get_default_memory_pool()
    engine = cache = None
    try:
        p = replace(params, n_gpu_layers=str(ngl), vram_budget=budget_bytes)
        engine = Engine.load(path, p, placeholder_weights=True)
        cache = engine.new_cache()
        engine.run_gpu_layers(cache, np.random.default_rng(0), params.n_ubatch)  # prefill micro-batch
        engine.run_gpu_layers(cache, np.random.default_rng(1), 1)  # one decode step
        cupy.cuda.runtime.deviceSynchronize()
        return FitAttempt(ngl, True, int(pool.total_bytes()))
    except PlacementError as exc:
        return FitAttempt(ngl, False, int(pool.total_bytes()), str(exc))
    except Exception as exc:  # noqa: BLE001 - CUDA/CuPy raise several types for out-of-memory
        if not _is_oom(exc):
            raise
        return FitAttempt(ngl, False, int(pool.total_bytes()), str(exc).splitlines()[0])
    finally:
        del cache
        if engine is not None:
            engine.close()
        del engine
        pool.free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def choose_ngl(path, params: EngineParams, budget_bytes: int, margin_bytes: int) -> tuple[int, int, int]:
    """`-ngl auto`: predict from the plan, check by measurement (as `hybrid probe`), and keep margin_bytes of
    headroom. Returns (chosen -ngl, measured ceiling, predicted)."""
    from gguf_io import ModelConfig, open_gguf  # noqa: PLC0415

    from .placement import plan  # noqa: PLC0415
    from .probe import find_ceiling, predict_max_ngl, recommend  # noqa: PLC0415

    with open_gguf(path) as f:
        config, tensors = ModelConfig.from_gguf(f), dict(f.tensors)
    p = params
    pred = predict_max_ngl(config, tensors, budget_bytes, p.n_ctx, p.type_k, p.type_v, p.n_ubatch, swa_full=True)
    search = find_ceiling(lambda n: try_fit(path, p, n, budget_bytes).fits, pred.ngl, config.n_layer + 1)
    rec = recommend(search.ceiling, lambda n: plan(config, tensors, budget_bytes, n, p.n_ctx, p.type_k, p.type_v,
                                                   p.n_ubatch, swa_full=True), margin_bytes)
    return rec.ngl, search.ceiling, pred.ngl
