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

from hybrid.backends.cpu import CpuBackend
from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams
from hybrid.errors import PlacementError
from hybrid.model import forward
from hybrid.plan.budget import plan_for
from hybrid.plan.moe_cache import MoeCacheRequest, fixed_part
from hybrid.plan.overrides import cpu_moe_overrides
from hybrid.plan.placement import PlacementPlan
from hybrid.plan.probe import (DEFAULT_MARGIN_BYTES, CeilingSearch, Prediction, Recommendation, bisect_ceiling,
                               find_ceiling, predict_max_ngl, recommend)

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
        engine = Engine.open(path, _fixed_cache(params))
        placement = plan_for(engine.config, engine.gguf.tensors, _UNLIMITED, ngl, engine.params.plan_inputs())
        gpu = GpuBackend()
        # op offload's buffers are in the overhead; an explicit --moe-cache is kept out of the pool (not allocated)
        gpu.limit_memory(max(0, budget_bytes - placement.overhead_bytes - placement.moe_cache.bytes))
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


def _fixed_cache(params: EngineParams) -> EngineParams:
    """params whose --moe-cache is what a plan reserves before it places layers: `auto` sizes the cache from what
    the chosen plan leaves (hybrid probe reports it), so the search for -ngl / --n-cpu-moe plans without it."""
    return replace(params, moe_cache=fixed_part(params.moe_cache))


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
    here is `plan_for` of these params: the bytes `hybrid run` with the same flags shows (an `auto` expert cache
    left out: it takes what the recommendation leaves). on_attempt sees each attempt as it ends (progress lines)."""
    params = _fixed_cache(params)
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


@dataclass(frozen=True)
class MoeProbeResult:
    """The smallest --n-cpu-moe with every other tensor on the GPU (-ngl all): predicted from the plan, measured
    (None in a dry run) and recommended with the margin. Searched as m = n_layer - N GPU layers with experts, so
    that the -ngl search (find_ceiling, recommend) applies as it is: more m, more VRAM."""

    n_layer: int
    predicted: int  # the smallest N whose plan fits the budget (n_layer + 1: none does)
    measured: int | None  # the smallest N that allocated and ran (None: not measured)
    recommended: int  # the smallest N >= the minimum whose plan leaves the margin
    headroom_bytes: int  # of the recommended plan
    gpu_bytes: int
    attempts: tuple[FitAttempt, ...]  # FitAttempt.ngl holds the N tried
    seconds: float

    @property
    def fits(self) -> bool:
        """Whether -ngl all fits at all (with every layer's experts on the CPU at worst)."""
        return self.recommended <= self.n_layer


def _with_n_cpu_moe(params: EngineParams, n: int) -> EngineParams:
    return replace(params, n_gpu_layers="all", overrides=params.overrides + cpu_moe_overrides(n_cpu_moe=n))


def probe_n_cpu_moe(config: ModelConfig, tensors: Mapping, params: EngineParams, budget_bytes: int,
                    margin_bytes: int = DEFAULT_MARGIN_BYTES, fit: Callable[[EngineParams], FitAttempt] | None = None,
                    on_attempt: Callable[[FitAttempt], None] | None = None) -> MoeProbeResult:
    """For an MoE model: the smallest --n-cpu-moe N at -ngl all, predicted from the plan (params' other flags),
    measured with fit(params with N) (e.g. try_fit at -ngl all; None: the prediction stands) among the N whose
    plan `hybrid run` accepts (so the measured minimum runs, and one below it is refused in one line), and
    recommended as the smallest N at or above it whose plan leaves margin_bytes of headroom."""
    n_layer = config.n_layer
    params = _fixed_cache(params)  # as probe_ngl: an `auto` expert cache takes what the recommendation leaves
    inputs_of = lambda m: _with_n_cpu_moe(params, n_layer - m).plan_inputs(params.n_ctx or config.n_ctx_train)  # noqa: E731

    def plan_m(m: int) -> PlacementPlan:
        return plan_for(config, tensors, budget_bytes, "all", inputs_of(m))

    def plan_fits(m: int) -> bool:
        try:
            p = plan_for(config, tensors, _UNLIMITED, "all", inputs_of(m))
        except PlacementError:
            return False
        return p.gpu_total_bytes <= budget_bytes

    predicted_m = bisect_ceiling(plan_fits, 0, n_layer)  # -1: not even N = n_layer fits
    attempts: list[FitAttempt] = []
    measured_m = None
    if fit is not None:
        def fits(m: int) -> bool:
            try:  # what `hybrid run` refuses is no minimum, whatever the device would hold
                plan_m(m)
            except PlacementError as exc:
                a = FitAttempt(n_layer - m, False, 0, f"refused by the plan: {exc}")
            else:
                a = fit(_with_n_cpu_moe(params, n_layer - m))
                a = FitAttempt(n_layer - m, a.fits, a.peak_bytes, a.error, a.seconds)
            attempts.append(a)
            if on_attempt is not None:
                on_attempt(a)
            return a.fits

        measured_m = find_ceiling(fits, max(predicted_m, 0), n_layer).ceiling
    ceiling_m = predicted_m if measured_m is None else measured_m
    if ceiling_m < 0:
        rec_m, headroom, gpu = -1, 0, 0
    else:
        rec = recommend(ceiling_m, plan_m, margin_bytes)
        rec_m, headroom, gpu = rec.ngl, rec.headroom_bytes, rec.gpu_bytes
    return MoeProbeResult(n_layer, n_layer - predicted_m, None if measured_m is None else n_layer - measured_m,
                          n_layer - rec_m, headroom, gpu, tuple(attempts), round(sum(a.seconds for a in attempts), 1))


def choose_n_cpu_moe(path, params: EngineParams, budget_bytes: int,
                     margin_bytes: int = DEFAULT_MARGIN_BYTES) -> MoeProbeResult:
    """`-ngl auto` on an MoE model: probe_n_cpu_moe measured on the device, each attempt at -ngl all."""
    from gguf_io import open_gguf  # noqa: PLC0415

    with open_gguf(path) as f:
        config, tensors = ModelConfig.from_gguf(f), dict(f.tensors)
    n_max = config.n_layer + 1
    return probe_n_cpu_moe(config, tensors, params, budget_bytes, margin_bytes,
                           lambda p: try_fit(path, p, n_max, budget_bytes))


def cache_alternative(config: ModelConfig, tensors: Mapping, params: EngineParams, budget: int,
                      n_max: int) -> PlacementPlan | None:
    """The plan with every layer on the GPU, every layer's routed experts in RAM (--cpu-moe) and the expert cache
    (--moe-cache auto) in the VRAM that frees, when the cache is on there (else None): the other way to spend a
    budget that holds only some layers' experts. Decode and prompt batches read the hot experts from the cache; a
    prompt batch uploads the other experts it uses (docs/MOE_CACHE.md). Predicted only (auto keeps its own
    margin); `hybrid probe` prints it as a second command."""
    if params.moe_cache.kind not in ("off", "auto") or any(o.explicit for o in params.overrides):
        return None
    alt = plan_for(config, tensors, budget, n_max, replace(params, overrides=cpu_moe_overrides(cpu_moe=True),
                                                           moe_cache=MoeCacheRequest("auto")).plan_inputs())
    return alt if alt.moe_cache.on else None
