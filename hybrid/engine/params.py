"""EngineParams: everything a command decides about loading and running a model, built by keyword."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.plan.budget import Ngl, PlanInputs, parse_ngl
from hybrid.plan.moe_cache import DEFAULT_INSERTS, DEFAULT_POLICY, MOE_CACHE_OFF, MoeCacheRequest, parse_moe_cache
from hybrid.plan.overrides import Override


@dataclass(frozen=True, kw_only=True)
class EngineParams:
    n_ctx: int = 4096  # -c; 0 = the model's training context
    n_batch: int = 2048  # -b: logical batch (how many prompt tokens one eval call takes)
    n_ubatch: int | None = 512  # -ub: physical micro-batch through the layers; None: auto (launch.resolve_ubatch)
    type_k: str = "f16"  # -ctk
    type_v: str = "f16"  # -ctv
    n_threads: int = 0  # -t; 0 = physical cores
    n_gpu_layers: Ngl = 0  # -ngl: N (repeating layers + output, as llama.cpp), "auto" or "all"
    vram_budget: int | None = None  # --vram-budget in bytes; None = the device's free memory
    flash_attn: bool = True  # -fa (our attention kernels are always flash-style; counted in the plan)
    use_mmap: bool = True  # --no-mmap: False reads the file into anonymous memory
    use_mlock: bool = False  # --mlock: lock the CPU-resident weights in RAM
    numa: str = ""  # --numa distribute|isolate|numactl ("" = off)
    cpus: tuple[int, ...] = ()  # -C/--cpu-mask, --cpu-range: the CPUs the workers are pinned to (() = all allowed)
    # op offload: big prefill batches run the CPU layers on the GPU, weights streamed (backends/op_offload.py). The
    # CLI turns it on (llama.cpp's default; --no-op-offload); off here, so a library caller's -ngl 0 stays on the CPU.
    op_offload: bool = False
    repack: bool = True  # --no-repack: False keeps the CPU layers' matrices as in the file (backends/repack.py)
    # -ot/--override-tensor, --cpu-moe, --n-cpu-moe as one ordered list (hybrid.plan.overrides.build_overrides)
    overrides: tuple[Override, ...] = ()
    # --moe-cache: a GPU cache of the hot routed experts of GPU layers whose experts stay in RAM (off by default;
    # hybrid/plan/moe_cache.py, hybrid/backends/moe_cache/runtime.py), its policy and its uploads a layer a step
    moe_cache: MoeCacheRequest = MOE_CACHE_OFF
    moe_cache_policy: str = DEFAULT_POLICY
    moe_cache_inserts: int = DEFAULT_INSERTS
    # the KV cache of new_cache in blocks through a table (hybrid.kv.paged), the design the server's slots share;
    # False: one contiguous storage a layer (the comparison scripts/bench_paged_kv.py makes)
    kv_paged: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_gpu_layers", parse_ngl(self.n_gpu_layers))
        object.__setattr__(self, "moe_cache", parse_moe_cache(self.moe_cache))

    def plan_inputs(self, n_ctx: int | None = None) -> PlanInputs:
        """The flags that decide the placement's bytes (n_ctx: the resolved context when params.n_ctx is 0)."""
        return PlanInputs(n_ctx=n_ctx or self.n_ctx, n_ubatch=min(self.n_ubatch, self.n_batch), type_k=self.type_k,
                          type_v=self.type_v, flash_attn=self.flash_attn, op_offload=self.op_offload,
                          overrides=self.overrides, moe_cache=self.moe_cache)
