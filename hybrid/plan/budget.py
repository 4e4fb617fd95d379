"""The one way a run's flags become a plan: the GPU overhead (op offload's buffers included) counted once, and
`plan_for`, which `hybrid run`, `--explain`, `hybrid probe` and `-ngl auto` all call, so the same flags show the
same bytes everywhere (-ngl is parsed by placement.parse_ngl, which plan() itself uses)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gguf_io import ModelConfig

from hybrid.plan.moe_cache import MOE_CACHE_OFF, MoeCacheRequest
from hybrid.plan.overrides import Override
from hybrid.plan.placement import (GEMM_CHUNK_ELEMENTS, GPU_OVERHEAD_BYTES, HOST_STAGING_SLOTS, Ngl, PlacementPlan,
                                   kv_bytes_per_cell, parse_ngl, plan, scratch_bytes)
from hybrid.system.sizes import MiB

STREAM_SLOTS = 3  # op offload's device slots: one read by the kernels, one being filled, one spare to run ahead
STREAM_PIECE_MAX_BYTES = 64 * MiB  # a slot's size at most; larger matrices (an output layer) stream in row pieces


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """The flags that decide a plan's bytes (EngineParams.plan_inputs() makes one)."""

    n_ctx: int
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    op_offload: bool = False  # streamed prefill of CPU layers: its buffers count where layers stay on the CPU
    overrides: tuple[Override, ...] = ()  # -ot, --cpu-moe, --n-cpu-moe (hybrid.plan.overrides), tried in order
    moe_cache: MoeCacheRequest = MOE_CACHE_OFF  # --moe-cache (hybrid.plan.moe_cache)


def row_pieces(n_rows: int, row_bytes: int, max_bytes: int = STREAM_PIECE_MAX_BYTES) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of a matrix, each of at most max_bytes (at least one row)."""
    rows = max(1, max_bytes // max(1, row_bytes))
    return [(r, min(n_rows, r + rows)) for r in range(0, n_rows, rows)]


def slot_bytes(tensors: Mapping, max_piece: int = STREAM_PIECE_MAX_BYTES) -> int:
    """One slot: the largest streamed piece of any 2-D tensor in `tensors` (objects with .shape and .nbytes)."""
    best = 0
    for t in tensors.values():
        if len(t.shape) == 2 and t.shape[0] > 0:
            row = t.nbytes // t.shape[0]
            r0, r1 = row_pieces(t.shape[0], row, max_piece)[0]
            best = max(best, (r1 - r0) * row)
    return best


def op_offload_bytes(config: ModelConfig, tensors: Mapping, n_ctx: int, n_ubatch: int, type_k: str = "f16",
                     type_v: str = "f16", flash_attn: bool = True, n_gpu_layers: int = 2) -> int:
    """VRAM op offload needs beyond the plan of -ngl n_gpu_layers: STREAM_SLOTS slots, one layer's KV cache
    uploaded for attention, the 1-D weights (norms, biases; uploaded once), HOST_STAGING_SLOTS runs of MoE experts
    (the experts a batch uses are uploaded in runs of as many as one dequantized fp16 chunk holds, into a ring of
    slots filled ahead of the kernels: HostExperts.run_uploaded), and the compute buffers of a layer and the output layer on the GPU where that plan lacks them:
    all of them and the fixed overhead at -ngl 0 (nothing is on the GPU), a layer's at -ngl 1 (the output only)."""
    vectors = sum(t.nbytes for t in tensors.values() if len(t.shape) == 1)
    expert = max((t.nbytes // t.shape[0] * min(t.shape[0], max(1, GEMM_CHUNK_ELEMENTS // (t.shape[1] * t.shape[2])))
                  for t in tensors.values() if len(t.shape) == 3 and t.shape[0]), default=0)
    need = (STREAM_SLOTS * slot_bytes(tensors) + n_ctx * kv_bytes_per_cell(config, type_k, type_v) + vectors
            + HOST_STAGING_SLOTS * expert)
    ngl = max(0, min(2, n_gpu_layers))
    need += (scratch_bytes(config, n_ctx, n_ubatch, flash_attn, 2).total
             - scratch_bytes(config, n_ctx, n_ubatch, flash_attn, ngl).total)
    return need + (GPU_OVERHEAD_BYTES if ngl == 0 else 0)


def overhead_bytes(config: ModelConfig, tensors: Mapping, inputs: PlanInputs, ngl: Ngl) -> int:
    """The plan's overhead for -ngl ngl: GPU_OVERHEAD_BYTES (CUDA context, cuBLAS workspace), plus op offload's
    buffers when it is on and layers stay on the CPU ("auto" counts as a split). The same bytes are what a
    measured fit keeps outside its memory pool, so that a measured ceiling is a plan `hybrid run` accepts."""
    ngl = parse_ngl(ngl)
    if not inputs.op_offload or ngl == "all" or (isinstance(ngl, int) and ngl > config.n_layer):
        return GPU_OVERHEAD_BYTES
    n = 2 if ngl == "auto" else ngl
    return GPU_OVERHEAD_BYTES + op_offload_bytes(config, tensors, inputs.n_ctx, inputs.n_ubatch, inputs.type_k,
                                                 inputs.type_v, inputs.flash_attn, n)


def plan_for(config: ModelConfig, tensors: Mapping, budget_bytes: int | None, ngl: Ngl,
             inputs: PlanInputs) -> PlacementPlan:
    """The plan of a run with these flags under budget_bytes (None: no GPU). Our cache holds n_ctx cells in
    sliding-window layers too (llama.cpp's swa_full)."""
    return plan(config, tensors, budget_bytes, parse_ngl(ngl), inputs.n_ctx, inputs.type_k, inputs.type_v,
                inputs.n_ubatch, inputs.flash_attn, overrides=inputs.overrides, swa_full=True,
                overhead_bytes=overhead_bytes(config, tensors, inputs, ngl), moe_cache=inputs.moe_cache)
