"""The measured half of `hybrid probe`: really allocate a candidate -ngl's GPU weights (placeholder bytes of the
real sizes: no upload of the real weights), KV cache and compute buffers, run one prefill micro-batch and one
decode step through the GPU layers, catch the out-of-memory error, and free everything; and the one chain
prediction -> measured ceiling -> recommendation that `hybrid probe` and `-ngl auto` share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from gguf_io import ModelConfig

from hybrid.backends.cpu import CpuBackend
from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams
from hybrid.errors import PlacementError
from hybrid.model import forward
from hybrid.plan.budget import plan_for
from hybrid.plan.probe import (DEFAULT_MARGIN_BYTES, CeilingSearch, Prediction, Recommendation, find_ceiling,
                               predict_max_ngl, recommend)

_UNLIMITED = 1 << 62  # a fit lifts the plan's own budget check: the device's allocator decides


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


def try_fit(path, params: EngineParams, ngl: int, budget_bytes: int) -> FitAttempt:
    """Load `ngl` layers with placeholder weights under a memory pool capped at the budget less the plan's
    overhead for this -ngl (what the process holds outside the pool, so that plan and measurement count alike;
    the plan's own check is lifted so the device decides), run a micro-batch of -ub tokens and one decode step
    through the GPU layers."""
    import cupy  # noqa: PLC0415 - only with a GPU

    from hybrid.backends.gpu import GpuBackend  # noqa: PLC0415

    pool = cupy.get_default_memory_pool()
    engine = cache = None
    t0 = time.perf_counter()

    def attempt(fits: bool, error: str = "") -> FitAttempt:
        return FitAttempt(ngl, fits, int(pool.total_bytes()), error, round(time.perf_counter() - t0, 2))

    try:
        engine = Engine.open(path, params)
        placement = plan_for(engine.config, engine.gguf.tensors, _UNLIMITED, ngl, engine.params.plan_inputs())
        gpu = GpuBackend()
        gpu.limit_memory(max(0, budget_bytes - placement.overhead_bytes))  # op offload's buffers are in it
        engine.place(placement, gpu, gpu.alloc_like)
        cache = engine.new_cache()
        run_gpu_layers(engine, cache, np.random.default_rng(0), engine.params.n_ubatch)  # prefill micro-batch
        run_gpu_layers(engine, cache, np.random.default_rng(1), 1)  # one decode step
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


def run_gpu_layers(engine: Engine, cache, rng: np.random.Generator, n_tokens: int) -> None:
    """Run n_tokens random hidden states through the engine's GPU layers and the output layer if it is on the
    GPU (what a fit needs to see the real peak memory; the CPU layers do not touch the VRAM)."""
    gpu_layers = [il for il, be in enumerate(engine.backends) if not isinstance(be, CpuBackend)]
    if not gpu_layers:
        return
    cfg, w = engine.config, engine.weights
    be = engine.backends[gpu_layers[0]]
    x = be.from_host(rng.standard_normal((n_tokens, cfg.n_embd)).astype(np.float32))
    positions = np.arange(cache.n_past, cache.n_past + n_tokens, dtype=np.int32)
    x = forward.layers(engine.spec, cfg, w, engine.backends, gpu_layers, x, positions, cache)
    if engine.output_backend is be:
        forward.head(be, cfg, w.output, w.output_norm, x)
    cache.n_past += n_tokens


def probe_ngl(config: ModelConfig, tensors: Mapping, params: EngineParams, budget_bytes: int,
              margin_bytes: int = DEFAULT_MARGIN_BYTES, fit: Callable[[int], FitAttempt] | None = None,
              on_attempt: Callable[[FitAttempt], None] | None = None) -> ProbeResult:
    """Predict the largest -ngl from the plan (params' n_ctx, KV types, -ub, op offload), find the real ceiling
    with fit(ngl) (e.g. `lambda n: try_fit(path, params, n, budget)`; None: no measurement, the prediction
    stands), and recommend the largest -ngl <= ceiling whose plan leaves margin_bytes of headroom. Every plan
    here is `plan_for` of these params: the bytes `hybrid run` with the same flags shows. on_attempt sees each
    attempt as it ends (progress lines)."""
    inputs = params.plan_inputs(params.n_ctx or config.n_ctx_train)

    pred = predict_max_ngl(config, tensors, budget_bytes, inputs)
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
    rec = recommend(ceiling, lambda n: plan_for(config, tensors, budget_bytes, n, inputs), margin_bytes)
    return ProbeResult(pred, search, tuple(attempts), rec, round(sum(a.seconds for a in attempts), 1))


def choose_ngl(path, params: EngineParams, budget_bytes: int, margin_bytes: int = DEFAULT_MARGIN_BYTES) -> ProbeResult:
    """`-ngl auto`: `probe_ngl` measured on the device (as `hybrid probe`); the choice is .recommendation.ngl."""
    from gguf_io import open_gguf  # noqa: PLC0415

    with open_gguf(path) as f:
        config, tensors = ModelConfig.from_gguf(f), dict(f.tensors)
    return probe_ngl(config, tensors, params, budget_bytes, margin_bytes,
                     lambda n: try_fit(path, params, n, budget_bytes))
