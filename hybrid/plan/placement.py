"""Which layers go to the GPU: a pure function from the tensor table, the config and a VRAM budget to a PlacementPlan.

llama.cpp's `-ngl` semantics: the model has n_layer + 1 offloadable layers (the repeating layers and the output
layer); `-ngl N` puts the output layer and the last N - 1 repeating layers on the GPU (i_gpu_start =
n_layer + 1 - N); `-ngl 999` / "all" puts everything there; "auto" takes the largest N that fits the budget.
token_embd.weight always stays on the CPU (its rows are gathered there); a tied output layer on the GPU needs
a GPU copy of it, counted as the output layer's bytes. The GPU's bytes, in the order they are reserved: the
KV cache of every GPU layer, the output layer, the repeating layers from the last one backwards, then the
compute buffers (see `scratch_bytes`) and a fixed overhead. The budget is the card's VRAM: CuPy's memory pool
(weights, KV cache, compute buffers) gets the budget less the overhead. No hardware is touched: only arithmetic.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Mapping

from gguf_io import ModelConfig

from hybrid.errors import HybridError, PlacementError, UnsupportedPlacement
from hybrid.kv.types import check_kv_types, kv_row_bytes
from hybrid.plan.explain import reasons
from hybrid.plan.moe_cache import MOE_CACHE_OFF, MoeCachePlan, MoeCacheRequest, resolve
from hybrid.plan.overrides import CPU_DEVICE, GPU_DEVICE, Override, cpu_moe_overrides, resolve_all
from hybrid.system.sizes import MiB, format_pair, format_size

# The CUDA context, cuBLAS workspace, loaded kernel images and the decode graphs' private pools: what a GPU
# process holds outside CuPy's memory pool. Counted once, as soon as anything is on the GPU; `hybrid probe` caps
# the pool at budget - GPU_OVERHEAD_BYTES so that measurement and plan count alike.
GPU_OVERHEAD_BYTES = 300 * MiB
# CuPy's pool rounds every allocation up to this many bytes.
POOL_UNIT = 512
# As kernels_gpu.matmul: prefill (>= GEMM_MIN_TOKENS tokens) dequantizes a weight in chunks of this many fp16
# values (rows rounded down to 128) for cuBLAS; the next chunk is made before the last one is dropped.
GEMM_MIN_TOKENS = 9
MATVEC_MAX_TOKENS = 8  # as kernels_gpu.matmul: an MoE batch of up to this many tokens takes the decode path
MOE_PAD_FREE_ROWS = 32  # as kernels_gpu.moe.PAD_FREE_ROWS: prefill pads an expert's group up to this many rows
GEMM_CHUNK_ELEMENTS = 1 << 26
# As hybrid/backends/host_experts.py: a big batch's experts kept in RAM are uploaded into this many device slots of
# a run of experts each (moe_max_run of them), allocated once.
HOST_STAGING_SLOTS = 3
# As kernels_gpu.matmul.matmul_many: q/k/v whose n_out x n_in sum is at most this are dequantized into one fp16
# scratch (one chunk reused) for one GEMM into a (T, sum n_out) product, then copied out per weight.
GEMM_STACK_ELEMENTS = GEMM_CHUNK_ELEMENTS
# llama.cpp pads the sliding-window cache (n_swa + n_ubatch) to a multiple of this many cells.
SWA_PAD = 256
GPU, CPU = "gpu", "cpu"
Ngl = int | str  # -ngl: an int >= 0, "auto" or "all"


class InvalidNgl(HybridError, ValueError):
    """An -ngl that is not a count >= 0, 'auto' or 'all'."""


_LAYER = re.compile(r"^blk\.(\d+)\.")
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(up|down|gate|gate_up)_(ch)?exps\.")  # llama.cpp's LLM_FFN_EXPS_REGEX


@dataclass(frozen=True)
class LayerPlacement:
    """One repeating layer: its device (attention, norms, dense FFN and KV cache live there) and its bytes."""

    index: int
    device: str  # "gpu" or "cpu"
    weight_bytes: int  # every blk.{index}.* tensor
    expert_bytes: int  # of which MoE expert tensors (ffn_{gate,up,down}_exps)
    experts_on_cpu: bool  # -ot/--n-cpu-moe: the routed experts stay in RAM even when the layer is on the GPU
    kv_bytes: int  # K + V cache, on the layer's device
    kv_cells: int  # positions the cache holds (n_ctx, or the sliding window)
    swa: bool

    @property
    def gpu_weight_bytes(self) -> int:
        if self.device != GPU:
            return 0
        return self.weight_bytes - (self.expert_bytes if self.experts_on_cpu else 0)

    @property
    def cpu_weight_bytes(self) -> int:
        return self.weight_bytes - self.gpu_weight_bytes

    @property
    def gpu_bytes(self) -> int:
        return self.gpu_weight_bytes + (self.kv_bytes if self.device == GPU else 0)

    @property
    def cpu_bytes(self) -> int:
        return self.cpu_weight_bytes + (self.kv_bytes if self.device == CPU else 0)


@dataclass(frozen=True)
class OutputPlacement:
    """The output layer: output_norm + output.weight, or (tied) a copy of token_embd.weight on the GPU."""

    device: str
    weight_bytes: int  # output_norm + the LM head bytes on `device` (a tied CPU head reads token_embd: 0 extra)
    head_bytes: int  # output.weight, or token_embd.weight when tied
    tied: bool


@dataclass(frozen=True)
class ScratchEstimate:
    """GPU compute buffers of one micro-batch (see `scratch_bytes`): the live bytes at the worst moment inside a
    repeating layer and inside the output layer, and the pool's slack on top of the larger of the two."""

    activations: int  # live peak inside a GPU layer (0 when only the output layer is on the GPU)
    logits: int  # live peak of the output layer: T x n_vocab logits and their GEMM staging
    slack: int  # freed blocks the pool cannot give back
    staging: int = 0  # upload slots of experts kept in RAM (-ot, --n-cpu-moe), held from the first big batch on

    @property
    def peak(self) -> int:
        """Bytes alive at once: the least the pool must hold, so an -ngl that needs more cannot run."""
        return max(self.activations, self.logits) + self.staging

    @property
    def total(self) -> int:
        """What the pool holds at its high-water mark (the peak and the slack): what `auto` plans for."""
        return self.peak + self.slack if self.peak else 0


@dataclass(frozen=True)
class PlacementPlan:
    """Where every layer runs and what each device holds. n_gpu_layers has llama.cpp's -ngl meaning."""

    layers: tuple[LayerPlacement, ...]
    output: OutputPlacement
    embedding_bytes: int  # token_embd.weight, always on the CPU
    other_bytes: int  # any other non-layer tensor (e.g. rope_freqs), on the CPU
    n_gpu_layers: int
    max_fit_ngl: int  # the largest -ngl that fits the budget with these settings
    requested_ngl: int | str
    budget_bytes: int
    gpu_weight_bytes: int
    gpu_kv_bytes: int
    scratch: ScratchEstimate
    overhead_bytes: int
    cpu_weight_bytes: int
    cpu_kv_bytes: int
    n_ctx: int
    type_k: str
    type_v: str
    n_ubatch: int
    flash_attn: bool
    overrides: tuple[Override, ...]  # -ot, --cpu-moe, --n-cpu-moe in the order they are tried
    reasons: tuple[str, ...]
    moe_cache: MoeCachePlan = MoeCachePlan()  # --moe-cache: the GPU cache of hot experts (hybrid/plan/moe_cache.py)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def i_gpu_start(self) -> int:
        """The first repeating layer on the GPU (n_layer when none is)."""
        return max(0, self.n_layer + 1 - self.n_gpu_layers)

    @property
    def gpu_layer_indices(self) -> tuple[int, ...]:
        return tuple(l.index for l in self.layers if l.device == GPU)

    @property
    def gpu_scratch_bytes(self) -> int:
        return self.scratch.total

    @property
    def gpu_total_bytes(self) -> int:
        return (self.gpu_weight_bytes + self.gpu_kv_bytes + self.scratch.total + self.overhead_bytes
                + self.moe_cache.bytes)

    @property
    def cpu_total_bytes(self) -> int:
        return self.cpu_weight_bytes + self.cpu_kv_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.gpu_total_bytes

    @property
    def n_cpu_moe(self) -> int:
        """How many layers keep their routed experts on the CPU (whatever overrides said so)."""
        return sum(l.experts_on_cpu for l in self.layers)

    def tensor_device(self, name: str) -> str:
        """Where tensor `name` lives under this plan: "gpu" or "cpu" (a tied output layer on the GPU is a copy of
        token_embd.weight, which itself stays on the CPU)."""
        m = _LAYER.match(name)
        if m and int(m.group(1)) < self.n_layer:
            lp = self.layers[int(m.group(1))]
            return CPU if lp.experts_on_cpu and _EXPERTS.match(name) else lp.device
        if name in ("output.weight", "output_norm.weight"):
            return self.output.device
        return CPU


def kv_bytes_per_cell(config: ModelConfig, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes one position takes in one layer's K and V cache (all KV heads)."""
    if config.n_lora_kv:  # MLA: one row [latent | rope key], read as the key and the value (hybrid.kv.cache)
        return config.n_head_kv * kv_row_bytes(type_k, config.n_embd_head_k)
    return config.n_head_kv * (kv_row_bytes(type_k, config.n_embd_head_k) + kv_row_bytes(type_v, config.n_embd_head_v))


def kv_cells(config: ModelConfig, il: int, n_ctx: int, n_ubatch: int = 512, swa_full: bool = False) -> int:
    """Positions layer il's cache holds: n_ctx, or for a sliding-window layer (gemma3) only the window.

    llama.cpp's SWA cache keeps n_swa + n_ubatch cells (the window plus one ubatch in flight), padded to 256,
    never more than n_ctx; `swa_full` (llama.cpp --swa-full) gives sliding layers the full n_ctx.
    """
    if swa_full or not config.n_swa or not config.swa_layers[il]:
        return n_ctx
    return min(n_ctx, -(-(config.n_swa + n_ubatch) // SWA_PAD) * SWA_PAD)


def scratch_bytes(config: ModelConfig, n_ctx: int, n_ubatch: int, flash_attn: bool, n_gpu_layers: int,
                  max_gpu_kv_cells: int | None = None, qkv_bias: bool = False) -> ScratchEstimate:
    """The compute buffers of a micro-batch of T = min(n_ubatch, n_ctx) tokens through the GPU's layers, in bytes.

    Not a sum of buffers: CuPy's pool hands freed blocks to the next allocation, so what counts is the largest set
    of buffers alive at one moment, each rounded to POOL_UNIT. Walking the GPU backend's ops (hybrid/model/arch/
    blocks.py over kernels_gpu) with A = T x n_embd float32 (the hidden state), the sets are:
      layer, FFN down (the largest): the caller's x, x + attn, attn, normed x (4 A), gate, up and act(gate) * up
      (3 x T x n_ff float32), the output (A), fp16 x (T x n_ff) and two dequantized weight chunks (see
      _gemm_bytes); MoE: kernels_gpu.moe's buffers (_moe_bytes); attention: x, normed x, q, k, v, the attention output (+ KQ scores without flash attention);
      output layer: x, normed x, the logits (T x n_vocab float32: every row, as perplexity asks) and its GEMM.
    q/k/v and gate/up are each one matmul_many (_matmuls_bytes): one fp16 x, and where they stack one GEMM (x16,
    the product and the scratch, then the product and its copies). A decode step reuses these blocks. Quantized weights assumed (F16/F32 weights stage less).
    Nothing when no layer is on the GPU.
    """
    if n_gpu_layers <= 0:
        return ScratchEstimate(0, 0, 0)
    t, c = min(n_ubatch, n_ctx), config
    f32 = lambda *dims: _pool_bytes(4 * math.prod(dims))  # noqa: E731
    hidden, positions = f32(t, c.n_embd), f32(t)
    n_q, n_k, n_v = c.n_head * c.n_embd_head_k, c.n_head_kv * c.n_embd_head_k, c.n_head_kv * c.n_embd_head_v
    logits = positions + 2 * hidden + _gemm_bytes(t, c.n_embd, c.n_vocab)
    activations = 0
    if n_gpu_layers >= 2:
        qkv = f32(t, n_q) + f32(t, n_k) + f32(t, n_v)
        held = positions + 2 * hidden  # the caller's x and the normed x
        n_kv = n_ctx if max_gpu_kv_cells is None else max_gpu_kv_cells
        attn = max(held + _matmuls_bytes(t, c.n_embd, (n_q, n_k, n_v)),
                   held + 2 * qkv if qkv_bias else 0,  # q + bias, ... made while q, k, v are alive
                   held + qkv + f32(t, c.n_head * c.n_embd_head_v)
                   + (0 if flash_attn else f32(t, c.n_head, n_kv)),  # the KQ scores
                   held + qkv + f32(t, c.n_head * c.n_embd_head_v) + _gemm_bytes(t, c.n_head * c.n_embd_head_v,
                                                                                  c.n_embd))
        held = positions + 4 * hidden  # x, x + attn, attn, normed
        if c.n_expert:
            ffn = max(held + _moe_bytes(t, c), positions + 6 * hidden)
        else:
            ffn = max(held + _matmuls_bytes(t, c.n_embd, (c.n_ff, c.n_ff)),
                      held + 3 * f32(t, c.n_ff) + _gemm_bytes(t, c.n_ff, c.n_embd), positions + 6 * hidden)
        activations = max(attn, ffn)
    # The slack: blocks the pool cannot give back because a small buffer (the hidden state, its normed copy) sits
    # in a split one. Replaying the allocations through a model of CuPy's pool (tests/test_placement_scratch.py)
    # leaves 20-35 MiB at T = 512 and up to 100 MiB at T = 128 for 8B/32B shapes, never more than the largest
    # dequantized weight chunk of a layer, or stacked GEMM scratch or product (the largest blocks a layer makes):
    # `auto` plans for that much.
    if n_gpu_layers < 2 or t < GEMM_MIN_TOKENS:
        slack = 2 * hidden
    else:
        slack = max(_chunk_bytes(n_in, n_out) for n_in, n_out in ((c.n_embd, n_q), (c.n_embd, n_k),
                                                                  (n_q, c.n_embd), (c.n_embd, c.n_ff),
                                                                  (c.n_ff, c.n_embd)))
        stacks = ((t, n_q + n_k + n_v),) + (() if c.n_expert else ((t, 2 * c.n_ff),))  # MoE: experts unstacked
        for te_, n_all in stacks:  # a stacked GEMM's scratch and product
            if _stacked(te_, c.n_embd, n_all):
                slack = max(slack, _stack_bytes(c.n_embd, n_all), f32(te_, n_all))
    return ScratchEstimate(activations, logits, slack)


def _moe_bytes(t: int, c: ModelConfig) -> int:
    """Live bytes of kernels_gpu.moe's MoE FFN of t tokens at its worst moment: the router logits, expert ids and
    weights, then for decode (t <= MATVEC_MAX_TOKENS) the t k slots' gate, up, GLU and down outputs; for prefill,
    with R = 2.5 t k + MOE_PAD_FREE_ROWS n_expert padded rows at most and the row maps, the gathered fp16 x, gate
    and up (float32), one run's dequantized experts and its GEMM's output; the GLU in float32 and fp16; the down
    output with a run's experts; the weighted sum (T x n_embd)."""
    k, e, n_ff, n = c.n_expert_used, c.n_expert, c.n_ff_exp, c.n_embd
    f32 = lambda *dims: _pool_bytes(4 * math.prod(dims))  # noqa: E731
    f16 = lambda *dims: _pool_bytes(2 * math.prod(dims))  # noqa: E731
    routing = f32(t, e) + 2 * f32(t, k)
    if t <= MATVEC_MAX_TOKENS:
        return routing + 3 * f32(t * k, n_ff) + f32(t * k, n) + f32(t, n)
    rows = 5 * t * k // 2 + MOE_PAD_FREE_ROWS * e  # padding <= 2x, then rounded up by <= 25% (moe._bucket)
    run = f16(min(e, max(1, GEMM_CHUNK_ELEMENTS // (n_ff * n))) * n_ff * n)  # one run of experts in fp16
    gate_up = f16(rows, n) + 2 * f32(rows, n_ff) + run
    glu = 3 * f32(rows, n_ff) + f16(rows, n_ff)
    down = f16(rows, n_ff) + f32(rows, n) + run
    return routing + _pool_bytes(4 * (rows + t * k)) + max(gate_up, glu, down) + f32(t, n)


def moe_max_run(shapes: tuple) -> int:
    """As kernels_gpu.moe.max_run: experts one dequantized fp16 chunk holds for the largest of the projections
    (shapes: the (n_out, n_in) of gate, up and down)."""
    return max(1, GEMM_CHUNK_ELEMENTS // max(1, max(n_out * n_in for n_out, n_in in shapes)))


def staging_slot_bytes(shapes: tuple, expert_bytes: int, n_expert: int) -> int:
    """One upload slot of experts kept in RAM: a run of experts as kernels_gpu.moe.prefill dequantizes them (as many
    as one fp16 chunk holds for the layer's largest projection, `shapes` the (n_out, n_in) of gate, up, down; never
    more than the layer's n_expert), of `expert_bytes` each (the largest of the three tensors' per-expert bytes)."""
    return min(n_expert, moe_max_run(shapes)) * expert_bytes


def host_staging_bytes(tensors: Mapping, layers) -> int:
    """The device slots a big batch uploads the RAM-kept experts of `layers` through: HOST_STAGING_SLOTS runs of
    experts of the largest of their tensors (0 when no layer is given)."""
    best = 0
    for il in layers:
        ts = [tensors.get(f"blk.{il}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
        if any(t is None or len(t.shape) != 3 for t in ts):
            continue
        shapes = tuple(tuple(int(d) for d in t.shape[1:]) for t in ts)
        n_expert = int(ts[0].shape[0])
        best = max(best, staging_slot_bytes(shapes, max(t.nbytes // n_expert for t in ts), n_expert))
    return HOST_STAGING_SLOTS * _pool_bytes(best) if best else 0


def _pool_bytes(n: int) -> int:
    return -(-n // POOL_UNIT) * POOL_UNIT


def _gemm_bytes(t: int, n_in: int, n_out: int) -> int:
    """Live bytes of one prefill matmul x (t, n_in) @ W.T: the float32 output, and for t >= GEMM_MIN_TOKENS the
    fp16 copy of x and the dequantized fp16 weight chunks, two alive while the next one is made."""
    out = _pool_bytes(4 * t * n_out)
    if t < GEMM_MIN_TOKENS:
        return out
    rows = _chunk_rows(n_in)
    second = min(rows, max(0, n_out - rows))
    return out + _pool_bytes(2 * t * n_in) + _chunk_bytes(n_in, n_out) + _pool_bytes(2 * second * n_in)


def _chunk_rows(n_in: int) -> int:
    """Rows of a weight kernels_gpu.matmul dequantizes at once for the prefill GEMM."""
    return max(128, GEMM_CHUNK_ELEMENTS // n_in // 128 * 128)


def _stacked(t: int, n_in: int, n_out: int) -> bool:
    """Whether matmul_many runs its weights (n_out rows in all, quantized) as one stacked GEMM at t tokens."""
    return t >= GEMM_MIN_TOKENS and n_out * n_in <= GEMM_STACK_ELEMENTS


def _matmuls_bytes(t: int, n_in: int, n_outs: tuple[int, ...]) -> int:
    """Live bytes of one matmul_many of x (t, n_in) by weights of n_outs rows, at its worst moment. Stacked: fp16
    x, the (t, sum n_outs) float32 product and the scratch, then the product and its copies; else one shared fp16
    x with the outputs made so far and the next weight's _gemm_bytes."""
    outs = [_pool_bytes(4 * t * n) for n in n_outs]
    if len(n_outs) >= 2 and _stacked(t, n_in, sum(n_outs)):
        product = _pool_bytes(4 * t * sum(n_outs))
        return max(_pool_bytes(2 * t * n_in) + product + _stack_bytes(n_in, sum(n_outs)), product + sum(outs))
    return max(sum(outs[:i]) + _gemm_bytes(t, n_in, n) for i, n in enumerate(n_outs))


def _stack_bytes(n_in: int, n_out: int) -> int:
    """The fp16 scratch of a stacked GEMM: one chunk, reused."""
    return _pool_bytes(2 * min(n_out, _chunk_rows(n_in)) * n_in)


def _chunk_bytes(n_in: int, n_out: int) -> int:
    """The first fp16 chunk of a dequantized (n_out, n_in) weight."""
    return _pool_bytes(2 * min(n_out, _chunk_rows(n_in)) * n_in)


def plan(config: ModelConfig, tensors: Mapping, budget_bytes: int | None, ngl: int | str, n_ctx: int,
         type_k: str = "f16", type_v: str = "f16", n_ubatch: int = 512, flash_attn: bool = True, *,
         overrides: tuple[Override, ...] = (), n_cpu_moe: int = 0, swa_full: bool = False,
         overhead_bytes: int = GPU_OVERHEAD_BYTES, moe_cache: MoeCacheRequest = MOE_CACHE_OFF) -> PlacementPlan:
    """The placement for `ngl` (an int >= 0, "all", or "auto": the largest that fits `budget_bytes`).

    `tensors` maps names to objects with `.nbytes` (GGUFFile.tensors). budget None means no GPU (0 bytes).
    `overrides` (hybrid.plan.overrides, tried in order, first match wins) move tensors off their layer's device:
    a GPU layer's routed experts to the CPU (`n_cpu_moe` adds --n-cpu-moe's overrides after them); other moves
    are refused with a PlacementError naming the tensor. `moe_cache` (--moe-cache): an explicit size is reserved
    like the layers' bytes (it counts in what fits); auto takes the headroom left after them. Raises
    PlacementError (one line, with the numbers) when the requested layers do not fit, ValueError for arguments out
    of range (unknown KV type, n_ctx < 1, ...).
    """
    budget = 0 if budget_bytes is None else int(budget_bytes)
    type_k, type_v = check_kv_types(type_k, type_v)
    if budget < 0 or n_ctx < 1 or n_ubatch < 1 or n_cpu_moe < 0:
        raise ValueError(f"need budget >= 0, n_ctx >= 1, n_ubatch >= 1, n_cpu_moe >= 0; found {budget}, {n_ctx}, "
                         f"{n_ubatch}, {n_cpu_moe}")
    overrides = tuple(overrides) + cpu_moe_overrides(n_cpu_moe=n_cpu_moe)
    costs = _Costs(config, tensors, n_ctx, type_k, type_v, n_ubatch, flash_attn, overrides, swa_full, overhead_bytes)
    n_max = config.n_layer + 1
    caches = [costs.moe_cache(k, moe_cache) for k in range(n_max + 1)]  # an explicit cache: off for auto here
    totals = [costs.gpu_parts(k) for k in range(n_max + 1)]
    max_fit = max(k for k in range(n_max + 1) if sum(totals[k]) + caches[k].bytes <= budget)  # k = 0 always fits
    k = _resolve_ngl(ngl, n_max, max_fit)
    # `auto` plans for the pool's high-water mark (the peak of live buffers and the slack); an explicit -ngl is
    # refused only when it cannot run, i.e. when even the buffers alive at once (a lower bound of what the pool
    # must hold) do not fit. Between the two the device decides: the slack depends on which blocks the allocator
    # happened to split, and `hybrid probe` measures it; its measured ceiling must not be refused here.
    w, kv, _, overhead = totals[k]
    least = (w + caches[k].bytes, kv, costs.scratch(k).peak, overhead)
    if sum(least) > budget:
        raise PlacementError(_too_big(k, least, budget, max_fit))
    costs.check_overrides(k)
    cache = caches[k] if moe_cache.kind != "auto" else costs.moe_cache(k, moe_cache, budget - sum(totals[k]))
    return costs.build(k, max_fit, ngl, budget, totals[k], totals[k + 1] if k < n_max else None, cache)


def _resolve_ngl(ngl: Ngl, n_max: int, max_fit: int) -> int:
    ngl = parse_ngl(ngl)
    return max_fit if ngl == "auto" else n_max if ngl == "all" else min(ngl, n_max)


def parse_ngl(value: int | str) -> Ngl:
    """-ngl as llama.cpp takes it: N (repeating layers + output), 'auto' or 'all'; InvalidNgl otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    key = str(value).strip().lower() or "0"
    if key in ("auto", "all"):
        return key
    if key.isdigit():
        return int(key)
    raise InvalidNgl(f"-ngl takes a number, 'auto' or 'all', got '{value}'")


def _too_big(k: int, parts: tuple[int, int, int, int], budget: int, max_fit: int) -> str:
    """parts: (weights, kv, peak of the compute buffers, overhead): the least that -ngl k needs."""
    need, have = format_pair(sum(parts), budget)
    w, kv, scratch, overhead = parts
    layers = "1 layer needs" if k == 1 else f"{k} layers need"
    return (f"{layers} at least {need} of the {have} VRAM budget (weights {format_size(w)}, KV cache "
            f"{format_size(kv)}, buffers {format_size(scratch + overhead)}); {max_fit} fit")


class _Costs:
    """The bytes of every part of the model once; gpu_parts(k) and build(k) for any -ngl k."""

    def __init__(self, config, tensors, n_ctx, type_k, type_v, n_ubatch, flash_attn, overrides, swa_full, overhead):
        c = self.config = config
        self.tensors = tensors
        self.settings = (n_ctx, type_k, type_v, n_ubatch, flash_attn, overrides)
        self.overhead = overhead
        n = c.n_layer
        self.weights, self.experts = [0] * n, [0] * n
        self.embedding = self.other = self.norm = 0
        head = None
        for name, t in tensors.items():
            m = _LAYER.match(name)
            if m and int(m.group(1)) < n:
                il = int(m.group(1))
                self.weights[il] += t.nbytes
                self.experts[il] += t.nbytes if _EXPERTS.match(name) else 0
            elif name == "token_embd.weight":
                self.embedding = t.nbytes
            elif name == "output.weight":
                head = t.nbytes
            elif name == "output_norm.weight":
                self.norm = t.nbytes
            else:
                self.other += t.nbytes
        self.tied = head is None
        self.qkv_bias = any(name.endswith(".attn_q.bias") for name in tensors)
        self.head = self.embedding if self.tied else head
        per_cell = kv_bytes_per_cell(c, type_k, type_v)
        self.cells = [kv_cells(c, il, n_ctx, n_ubatch, swa_full) for il in range(n)]
        self.kv = [cells * per_cell for cells in self.cells]
        self.moved = resolve_all(tensors, overrides)  # tensor -> "CPU" / "CUDA0", for the ones an override matches
        self.cpu_moe = [False] * n
        experts: dict[int, list[str]] = {}
        for name in tensors:
            m = _LAYER.match(name)
            if m and int(m.group(1)) < n and _EXPERTS.match(name):
                experts.setdefault(int(m.group(1)), []).append(name)
        for il, names in experts.items():
            on_cpu = [self.moved.get(name) == CPU_DEVICE for name in names]
            if any(on_cpu) and not all(on_cpu):
                split = next(nm for nm, c_ in zip(names, on_cpu) if not c_)
                raise UnsupportedPlacement(f"the overrides move some routed-expert tensors of layer {il} to the CPU but not "
                                     f"{split}: hybrid keeps a layer's experts together (use a pattern such as "
                                     f"'blk\\.{il}\\.ffn_.*_exps=CPU')")
            self.cpu_moe[il] = all(on_cpu)

    def on_gpu(self, il: int, k: int) -> bool:
        return il >= self.config.n_layer + 1 - k

    def gpu_parts(self, k: int) -> tuple[int, int, int, int]:
        """(weights, kv, scratch, overhead) bytes on the GPU for -ngl k."""
        if k == 0:
            return 0, 0, 0, 0
        gpu = [il for il in range(self.config.n_layer) if self.on_gpu(il, k)]
        weights = self.norm + self.head + sum(self.weights[il] - self.experts[il] * self.cpu_moe[il] for il in gpu)
        kv = sum(self.kv[il] for il in gpu)
        return weights, kv, self.scratch(k).total, self.overhead

    def check_overrides(self, k: int) -> None:
        """PlacementError for an override hybrid cannot carry out at -ngl k: what is not a GPU layer's routed
        experts moved to the CPU (or a no-op: a tensor sent where it goes anyway)."""
        n = self.config.n_layer
        for name, device in self.moved.items():
            m = _LAYER.match(name)
            if m and int(m.group(1)) < n:
                il = int(m.group(1))
                here = GPU_DEVICE if self.on_gpu(il, k) else CPU_DEVICE
                if device == here or (device == CPU_DEVICE and self.cpu_moe[il]):
                    continue
                where = f"layer {il} is on the {'GPU' if here == GPU_DEVICE else 'CPU'} (-ngl {k})"
            elif name in ("output.weight", "output_norm.weight"):
                here = GPU_DEVICE if k >= 1 else CPU_DEVICE
                if device == here:
                    continue
                where = f"the output layer is on the {'GPU' if k >= 1 else 'CPU'} (-ngl {k})"
            elif device == CPU_DEVICE:
                continue  # token_embd and the other non-layer tensors are on the CPU already
            else:
                where = f"{name} stays on the CPU"
            raise UnsupportedPlacement(f"override {name}={device} is not supported: {where}; hybrid moves whole layers "
                                 f"(-ngl) and a GPU layer's routed experts to the CPU (-ot '...ffn_.*_exps=CPU', "
                                 f"--cpu-moe, --n-cpu-moe)")

    def moe_cache(self, k: int, req: MoeCacheRequest, left: int | None = None) -> MoeCachePlan:
        """The expert cache of `req` at -ngl k over its GPU layers with experts in RAM (auto: from `left` bytes;
        without them, off)."""
        if req.kind == "off" or (req.kind == "auto" and left is None):
            return MoeCachePlan()
        host = [il for il in range(self.config.n_layer) if self.on_gpu(il, k) and self.cpu_moe[il] and self.experts[il]]
        plain = [il for il in host if f"blk.{il}.ffn_gate_exps.bias" not in self.tensors]
        if host and not plain:  # the runtime caches no expert with biases (backends/moe_cache/runtime.cacheable)
            return MoeCachePlan(note="moe cache off: the routed experts carry biases (gpt-oss), which it does not cache")
        return resolve(req, self.tensors, plain, self.config.n_expert, self.config.n_expert_used, left)

    def scratch(self, k: int) -> ScratchEstimate:
        n_ctx, _, _, n_ubatch, flash_attn, _ = self.settings
        max_cells = max((self.cells[il] for il in range(self.config.n_layer) if self.on_gpu(il, k)), default=0)
        s = scratch_bytes(self.config, n_ctx, n_ubatch, flash_attn, k, max_cells, self.qkv_bias)
        host = [il for il in range(self.config.n_layer) if self.on_gpu(il, k) and self.cpu_moe[il]]
        return replace(s, staging=host_staging_bytes(self.tensors, host)) if host else s

    def build(self, k: int, max_fit: int, requested, budget: int, parts, next_parts,
              cache: MoeCachePlan = MoeCachePlan()) -> PlacementPlan:
        n_ctx, type_k, type_v, n_ubatch, flash_attn, overrides = self.settings
        layers = tuple(
            LayerPlacement(il, GPU if self.on_gpu(il, k) else CPU, self.weights[il], self.experts[il],
                           self.on_gpu(il, k) and self.cpu_moe[il] and self.experts[il] > 0, self.kv[il], self.cells[il],
                           bool(self.config.n_swa) and self.config.swa_layers[il])
            for il in range(self.config.n_layer)
        )
        out_dev = GPU if k >= 1 else CPU
        out_bytes = self.norm + (self.head if out_dev == GPU or not self.tied else 0)
        output = OutputPlacement(out_dev, out_bytes, self.head, self.tied)
        scratch = self.scratch(k)
        weights, kv, _, overhead = parts
        cpu_w = self.embedding + self.other + sum(l.cpu_weight_bytes for l in layers) + (out_bytes if k == 0 else 0)
        cpu_kv = sum(l.kv_bytes for l in layers if l.device == CPU)
        p = PlacementPlan(layers, output, self.embedding, self.other, k, max_fit, requested, budget, weights, kv,
                          scratch, overhead, cpu_w, cpu_kv, n_ctx, type_k, type_v, n_ubatch, flash_attn, overrides, (),
                          cache)
        return replace(p, reasons=reasons(p, next_parts))
