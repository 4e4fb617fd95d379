"""The measured half of `hybrid probe`: really allocate a candidate -ngl's GPU weights (placeholder bytes of the
real sizes: no upload of the real weights), KV cache and compute buffers, run one prefill micro-batch and one
decode step through the GPU layers, catch the out-of-memory error, and free everything; and the one chain
prediction -> measured ceiling -> recommendation that `hybrid probe` and `-ngl auto` share."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from gguf_io import ModelConfig

from hybrid.engine.engine import Engine, EngineParams
from hybrid.errors import PlacementError
from hybrid.backends.op_offload import gpu_overhead_bytes
from hybrid.plan.placement import GPU_OVERHEAD_BYTES, plan
from hybrid.plan.probe import (DEFAULT_MARGIN_BYTES, CeilingSearch, Prediction, Recommendation, find_ceiling, predict_max_ngl,
                    recommend)


@dataclass(frozen=True)
class FitAttempt:
    ngl: int
    fits: bool
    peak_bytes: int  # the memory pool's peak during the attempt
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class ProbeResult:
    """What `hybrid probe` and `-ngl auto` found: the plan's prediction, the attempts on the device (none in a dry
    run, where the ceiling is the prediction) and the recommendation that keeps the margin."""

    prediction: Prediction
    search: CeilingSearch | None  # None: not measured (dry run)
    attempts: tuple[FitAttempt, ...]  # in call order
    recommendation: Recommendation
    seconds: float  # spent on the attempts

    @property
    def ceiling(self) -> int:
        return self.prediction.ngl if self.search is None else self.search.ceiling


def _is_oom(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("OutOfMemoryError", "MemoryError") or "out of memory" in str(exc).lower()


def try_fit(path, params: EngineParams, ngl: int, budget_bytes: int,
            reserve_bytes: int = GPU_OVERHEAD_BYTES) -> FitAttempt:
    """Load `ngl` layers with placeholder weights under a memory pool capped at budget_bytes - reserve_bytes (the
    plan's overhead: what the process holds outside the pool, so that plan and measurement count alike; the
    plan's own check is lifted so the device decides), run a micro-batch of -ub tokens and one decode step."""
    import cupy  # noqa: PLC0415 - only with a GPU

    pool = cupy.get_default_memory_pool()
    engine = cache = None
    t0 = time.perf_counter()

    def attempt(fits: bool, error: str = "") -> FitAttempt:
        return FitAttempt(ngl, fits, int(pool.total_bytes()), error, round(time.perf_counter() - t0, 2))

    try:
        # op offload's stream buffers are in reserve_bytes (gpu_overhead_bytes), not allocated a second time
        p = replace(params, n_gpu_layers=str(ngl), vram_budget=max(0, budget_bytes - reserve_bytes),
                    op_offload=False)
        engine = Engine.load(path, p, placeholder_weights=True)
        cache = engine.new_cache()
        engine.run_gpu_layers(cache, np.random.default_rng(0), params.n_ubatch)  # prefill micro-batch
        engine.run_gpu_layers(cache, np.random.default_rng(1), 1)  # one decode step
        cupy.cuda.runtime.deviceSynchronize()
        return attempt(True)
    except PlacementError as exc:
        return attempt(False, str(exc))
    except Exception as exc:  # noqa: BLE001 - CUDA/CuPy raise several types for out-of-memory
        if not _is_oom(exc):
            raise
        return attempt(False, str(exc).splitlines()[0])
    finally:
        del cache
        if engine is not None:
            engine.close()
        del engine
        pool.free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def probe_ngl(config: ModelConfig, tensors: Mapping, params: EngineParams, budget_bytes: int,
              margin_bytes: int = DEFAULT_MARGIN_BYTES, fit: Callable[[int], FitAttempt] | None = None,
              on_attempt: Callable[[FitAttempt], None] | None = None,
              overhead_bytes: int | None = None) -> ProbeResult:
    """Predict the largest -ngl from the plan (params' n_ctx, KV types, -ub), find the real ceiling with fit(ngl)
    (e.g. `lambda n: try_fit(path, params, n, budget)`; None: no measurement, the prediction stands), and
    recommend the largest -ngl <= ceiling whose plan leaves margin_bytes of headroom. on_attempt sees each
    attempt as it ends (progress lines). overhead_bytes must be what the engine's plan counts (and what fit
    reserves outside the pool), or the measured ceiling and the plan of `hybrid run` disagree; None: that of
    params (`probe_overhead_bytes`)."""
    if overhead_bytes is None:
        overhead_bytes = probe_overhead_bytes(config, tensors, params)
    p = params
    pred = predict_max_ngl(config, tensors, budget_bytes, p.n_ctx, p.type_k, p.type_v, p.n_ubatch,
                           flash_attn=p.flash_attn, swa_full=True, overhead_bytes=overhead_bytes)
    attempts: list[FitAttempt] = []
    search = None
    if fit is not None:
        def fits(n: int) -> bool:
            a = fit(n)
            attempts.append(a)
            if on_attempt is not None:
                on_attempt(a)
            return a.fits

        search = find_ceiling(fits, pred.ngl, config.n_layer + 1)
    ceiling = pred.ngl if search is None else search.ceiling
    rec = recommend(ceiling, lambda n: plan(config, tensors, budget_bytes, n, p.n_ctx, p.type_k, p.type_v,
                                            p.n_ubatch, p.flash_attn, swa_full=True, overhead_bytes=overhead_bytes),
                    margin_bytes)
    return ProbeResult(pred, search, tuple(attempts), rec, round(sum(a.seconds for a in attempts), 1))


def probe_overhead_bytes(config: ModelConfig, tensors: Mapping, params: EngineParams) -> int:
    """The overhead a probe plans with and keeps outside the pool: the engine's, for a split (`-ngl auto`)."""
    p = params
    return gpu_overhead_bytes(config, tensors, p.n_ctx, p.n_ubatch, p.type_k, p.type_v, p.flash_attn, p.op_offload,
                              "auto")


def choose_ngl(path, params: EngineParams, budget_bytes: int, margin_bytes: int = DEFAULT_MARGIN_BYTES) -> ProbeResult:
    """`-ngl auto`: `probe_ngl` measured on the device (as `hybrid probe`); the choice is .recommendation.ngl."""
    from gguf_io import open_gguf  # noqa: PLC0415

    with open_gguf(path) as f:
        config, tensors = ModelConfig.from_gguf(f), dict(f.tensors)
    overhead_bytes = probe_overhead_bytes(config, tensors, params)
    return probe_ngl(config, tensors, params, budget_bytes, margin_bytes,
                     lambda n: try_fit(path, params, n, budget_bytes, overhead_bytes), overhead_bytes=overhead_bytes)
