"""Op offload (llama.cpp's default; --no-op-offload turns it off): a micro-batch of >= OP_OFFLOAD_MIN_BATCH
tokens runs the CPU-resident layers on the GPU, their weights streamed from host memory for the batch.

Only the KV cache of those layers stays where it is, in host memory (hybrid/backends/offload.py). The matrices
go through a WeightStream (kernels_gpu.transfer): a ring of STREAM_SLOTS device slots filled ahead of their use
from pinned chunks, in the order the layers use them (`stream_order`); a matrix larger than a slot streams in
row pieces. Here: the decision, that order, and OpOffload, which swaps the CPU layers of a batch for the offload
backend and hands out the streamed pieces (the sizes the plan reserves for it are in hybrid/plan/budget.py).

A decode batch of several sequences (the server's, below llama.cpp's 32 tokens) runs its CPU layers on the CPU or,
streamed, on the GPU: whichever DecodeChoice measured faster at that batch size on this machine. The CPU's cost
grows with the rows, the stream's does not (it moves the layers' bytes over PCIe once a step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np

from gguf_io import ModelConfig

from hybrid.backends.cpu import CpuBackend
from hybrid.backends.offload import OffloadBackend
from hybrid.errors import PlacementError
from hybrid.plan.budget import STREAM_SLOTS, op_offload_bytes, row_pieces, slot_bytes
from hybrid.system.sizes import format_size
from hybrid.model.weights import Weight

OP_OFFLOAD_MIN_BATCH = 32  # llama.cpp: ggml-cuda's offload_op takes ops of >= 32 tokens (min_batch_size)
# The order the shared blocks (hybrid/model/arch/blocks.py) multiply a layer's matrices; others follow in dict order.
MATRIX_ORDER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down",
                "output")


def wants_offload(n_tokens: int, min_batch: int = OP_OFFLOAD_MIN_BATCH) -> bool:
    """True when a batch of n_tokens is worth moving the CPU layers' weights over PCIe (llama.cpp's rule)."""
    return n_tokens >= min_batch


class DecodeChoice:
    """Per decode batch size n (lo <= n < hi): whether its CPU layers run streamed on the GPU, by measurement.

    Until a size is decided, its batches try the two ways in turn (the CPU first), `trials` of each; then the way
    with the lower best time wins for good. A decided size settles the others without trials: the CPU's time grows
    with the rows and the stream's does not, so the stream winning at m wins at every n > m, and the CPU winning
    at m wins at every n < m. Sizes outside [lo, hi) are not its call (streamed: n >= hi)."""

    def __init__(self, lo: int = 2, hi: int = OP_OFFLOAD_MIN_BATCH, trials: int = 3) -> None:
        self.lo, self.hi, self.trials = lo, hi, trials
        self.decided: dict[int, bool] = {}
        self.times: dict[tuple[int, bool], list[float]] = {}

    def streamed(self, n: int) -> bool:
        """Whether this batch of n rows should run streamed (a trial while n is undecided)."""
        if n < self.lo or n >= self.hi:
            return n >= self.hi
        known = self.known(n)
        if known is not None:
            return known
        return len(self.times.get((n, False), ())) > len(self.times.get((n, True), ()))

    def known(self, n: int) -> bool | None:
        """The way size n is settled on, by its own trials or by a decided neighbour; None while undecided."""
        if n in self.decided:
            return self.decided[n]
        if any(s and m <= n for m, s in self.decided.items()):
            return True
        if any(not s and m >= n for m, s in self.decided.items()):
            return False
        return None

    def record(self, n: int, streamed: bool, seconds: float) -> None:
        """A batch of n rows took `seconds` (the CPU layers' run, to the hidden state on the host)."""
        if self.known(n) is not None or not self.lo <= n < self.hi:
            return
        self.times.setdefault((n, streamed), []).append(seconds)
        cpu, gpu = self.times.get((n, False), []), self.times.get((n, True), [])
        if len(cpu) >= self.trials and len(gpu) >= self.trials:
            self.decided[n] = min(gpu) < min(cpu)

    def describe(self) -> str:
        """The sizes decided so far ('CPU at 2, 4 rows; streamed at 8 rows'), for a report."""
        on = sorted(n for n, s in self.decided.items() if s)
        off = sorted(n for n, s in self.decided.items() if not s)
        parts = ([f"CPU at {', '.join(map(str, off))} rows"] if off else []) + (
            [f"streamed at {', '.join(map(str, on))} rows"] if on else [])
        return "; ".join(parts) or "undecided"


def stream_order(lw: Mapping[str, Weight]) -> list[str]:
    """The keys of lw's 2-D matrices in the order the blocks use them. 3-D expert tensors are left out: which
    experts a batch needs is known only after routing (they are uploaded when asked for)."""
    mats = [k for k, w in lw.items() if w.raw.ndim == 2]
    return [k for k in MATRIX_ORDER if k in mats] + [k for k in mats if k not in MATRIX_ORDER]


class OpOffload:
    """Runs big batches of CPU-resident layers on `gpu` (a GpuBackend) on weights streamed by `stream`
    (a kernels_gpu.transfer.WeightStream); `backend` is the layers' backend for such a batch."""

    def __init__(self, gpu, cpu: CpuBackend, stream, min_batch: int = OP_OFFLOAD_MIN_BATCH,
                 max_piece: int | None = None) -> None:
        self.gpu, self.cpu, self.stream = gpu, cpu, stream
        self.min_batch = min_batch
        self.max_piece = int(max_piece if max_piece is not None else stream.slot_bytes)
        self.backend = OffloadBackend(gpu, cpu, self)
        self._vectors: dict[str, Weight] = {}  # 1-D weights (norms, biases) of CPU layers, uploaded once
        self._pending: deque[tuple[str, int, int]] = deque()  # (name, r0, r1) streaming in this batch, in order
        self.batches = 0  # batches run so far (a count for tests and reports)
        self.streamed_bytes = 0  # weight bytes streamed so far
        self.register_note: str | None = None  # None: not tried yet; "": registered; else why not (staged copies)
        self.decode = DecodeChoice(hi=min_batch)  # decode batches below min_batch: the CPU or the stream, measured

    def describe(self) -> str:
        """Batches run, bytes streamed, and how: DMA straight from page-locked host memory, or staged copies."""
        how = {None: "", "": ", direct from page-locked host memory"}.get(
            self.register_note, f", staged through pinned buffers ({self.register_note})")
        decode = f"; decode batches: {self.decode.describe()}" if self.decode.decided else ""
        return f"{self.batches} batches, {format_size(self.streamed_bytes, 2)} streamed{how}{decode}"

    def wants(self, n_tokens: int) -> bool:
        return wants_offload(n_tokens, self.min_batch)

    def pieces(self, w: Weight) -> list[tuple[int, int]]:
        return row_pieces(w.raw.shape[0], w.raw.shape[1] * w.raw.itemsize, self.max_piece)

    @contextmanager
    def batch(self, backends: list, layers: list[dict[str, Weight]],
              within: range | None = None) -> Iterator[tuple[list, list]]:
        """Within: (backends, layers) where each CPU entry (of the layers `within`, default all) is swapped for the
        offload backend and its weights (1-D ones on the GPU); their matrices stream in stream_order from the
        start."""
        backends, layers = list(backends), list(layers)
        sources = []
        pending: deque[tuple[str, int, int]] = deque()
        for i, be in enumerate(backends):
            if not isinstance(be, CpuBackend) or (within is not None and i not in within):
                continue
            lw = {k: self._vector(w) if w.raw.ndim == 1 else w for k, w in layers[i].items()}
            backends[i], layers[i] = self.backend, lw
            for k in stream_order(lw):
                raw = lw[k].raw
                for r0, r1 in self.pieces(lw[k]):
                    pending.append((lw[k].name, r0, r1))
                    sources.append(raw[r0:r1].reshape(-1).view(np.uint8))
        self._pending = pending
        if sources and self.register_note is None:  # once: page-lock the CPU layers' weights for direct DMA
            self.register_note = self.stream.register(sources)
        self.stream.start(sources)
        if sources:
            self.batches += 1
            self.streamed_bytes += sum(s.nbytes for s in sources)
        try:
            yield backends, layers
        finally:
            self.stream.stop()
            self._pending = deque()

    @contextmanager
    def piece(self, w: Weight, r0: int, r1: int):
        """Rows [r0, r1) of host matrix w on the GPU as cupy uint8 (r1 - r0, row_bytes), valid within: from the
        stream when it is streaming in this batch (pieces streamed ahead of it but not asked for are skipped),
        else uploaded now through the pinned stager."""
        key = (w.name, r0, r1)
        row_bytes = w.raw.shape[1] * w.raw.itemsize
        if key not in self._pending:  # not in the batch's order (an MoE expert, a matrix used twice)
            yield self.gpu.upload(Weight(w.name, w.type_name, w.shape, w.raw[r0:r1])).raw
            return
        while True:
            k = self._pending.popleft()
            slot = self.stream.take()
            if k == key:
                break
            self.stream.release(slot)
        try:
            yield self.stream.view(slot, (r1 - r0) * row_bytes).reshape(r1 - r0, row_bytes)
        finally:
            self.stream.release(slot)

    def _vector(self, w: Weight) -> Weight:
        if w.name not in self._vectors:
            self._vectors[w.name] = self.gpu.upload(w)
        return self._vectors[w.name]

    def close(self) -> None:
        self.stream.close()
        self._vectors = {}


def make_op_offload(backends: list, output_backend, config: ModelConfig, tensors: Mapping, n_ctx: int,
                    n_ubatch: int, type_k: str, type_v: str, flash_attn: bool, vram_budget: int | None,
                    progress: Callable[[str], None] | None = None) -> OpOffload | None:
    """An OpOffload for an engine with CPU layers, on its GPU backend, or (-ngl 0) on a new one when a GPU is
    usable, under vram_budget (None: the free memory); None when every layer is on the GPU or there is no GPU.
    Raises PlacementError when -ngl 0's budget cannot hold the offload buffers."""
    from hybrid.system.devices import probe_gpus  # noqa: PLC0415

    everything = [*backends, output_backend]
    if not any(isinstance(b, CpuBackend) for b in everything):
        return None
    cpu = next(b for b in everything if isinstance(b, CpuBackend))
    gpu = next((b for b in everything if not isinstance(b, CpuBackend)), None)
    if gpu is None:  # -ngl 0: the GPU serves the big batches only
        gpus, why = probe_gpus()
        if not gpus:
            if progress:
                progress(f"op offload: off, no usable GPU ({why})")
            return None
        from hybrid.backends.gpu import GpuBackend  # noqa: PLC0415 - CuPy is optional

        gpu = GpuBackend()
        budget = vram_budget if vram_budget is not None else gpu.free_bytes()
        need = op_offload_bytes(config, tensors, n_ctx, n_ubatch, type_k, type_v, flash_attn, n_gpu_layers=0)
        if need > budget:
            raise PlacementError(f"op offload needs {format_size(need)} of VRAM for its buffers, the budget is "
                                 f"{format_size(budget)}; raise --vram-budget or pass --no-op-offload")
        gpu.limit_memory(budget)
    from kernels_gpu.transfer import WeightStream  # noqa: PLC0415

    with gpu.device:
        stream = WeightStream(slot_bytes(tensors), STREAM_SLOTS)
    if progress:
        progress(f"op offload: batches of >= {OP_OFFLOAD_MIN_BATCH} tokens run the CPU layers on the GPU, weights "
                 f"streamed through {STREAM_SLOTS} x {format_size(stream.slot_bytes)} of VRAM")
    return OpOffload(gpu, cpu, stream)
