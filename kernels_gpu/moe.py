"""The MoE FFN on the GPU as llama.cpp's MUL_MAT_ID: routing on the device, the selected experts read in place.

`moe_ffn(h, router, gate, up, down, routing, act)`: h cupy float32 (n_tok, n_embd), the normed input; router a
2-D weight, gate/up/down the 3-D expert tensors (raw uint8 (n_expert, n_out, row_bytes) on the device), each as
(raw, GGML type); routing a `Router` (plain softmax, or the gated forms: sigmoid, a selection bias, groups, a scale,
gpt-oss's softmax of the selected with the router's bias); biases, optionally, the experts' bias rows (gpt-oss).
Returns (n_tok, n_embd) float32, the experts' outputs summed with their routing weights (plus a residual, when one
is given: added in that sum's kernel).

Decode (n_tok <= MATVEC_MAX_TOKENS): the router matvec, `moe_route_softmax` or `moe_route_gated` (top-k and weights,
one CTA a token) - for one token with an F32 router, `moe_router_route`: the matvec, the routing and the 8-bit
quantization of h in one launch (`router_route`) -, one launch for gate and up over every (token, selected expert)
slot (`matvec_q8id_*` on 8-bit activations for the Q8_MATVEC types, `matvec_id_*` on float activations for the
others), the GLU, one launch for down on each slot's own GLU output, and `moe_combine`: no host synchronization, so
a decode step stays one CUDA graph.

Prefill of experts resident on the device (`prefill_mma`): the same routing, then the (token, expert) pairs grouped
by expert on the device (`group`: rows in expert order, tiles of up to MM_BM rows of one expert), one tensor-core
launch for gate and up with the GLU and one for down (moe_mma.cu: the quantized blocks dequantized tile by tile into
shared memory), `moe_combine` adding each token's rows back with its weights; no host synchronization.

Prefill of experts uploaded for the batch runs on the same tensor-core kernels (kernels_gpu.moe_upload: the used
experts copied into compact slots a chunk at a time). Where those kernels cannot (gate and up of two types, experts
in a repacked layout, a slot too small for an expert) `prefill` runs instead: the
pairs grouped on the host (one copy of the ids back: the group sizes set the GEMM shapes) into runs of consecutive
used experts of similar group sizes, the tokens gathered into one fp16 matrix with each run's groups padded to its
largest, and each run of each projection one contiguous dequantization to fp16 and one strided-batched cuBLAS GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .matmul import (GEMM_CHUNK_ELEMENTS, GPU_KERNELS, MATVEC_MAX_TOKENS, MV_WARPS, Q6S_NB, Q6S_WARPS, Q8_KERNEL,
                     Q8_BLOCK, Q8_MATVEC, float_wpr, gpu_kernel, matmul, matvec_config, q8_config, q8_empty,
                     quantize_q8_1)
from .module import get_kernel
from .ops import GLU_ACTS, glu

MOE_MAX_EXPERTS = 1024  # moe_route_softmax's shared-memory table (MOE_MAX_EXPERTS in moe.cu)
MOE_MAX_K = 64  # experts a token at most (MOE_MAX_K in moe.cu)
MOE_MAX_GROUPS = 64  # expert groups at most (MOE_MAX_GROUPS in moe.cu)
MOE_ROUTE_THREADS = 128  # threads a token in moe_route_softmax / moe_route_gated
GATINGS = {"softmax": 0, "sigmoid": 1, "softmax_weight": 2}  # moe_route_gated's gating codes
SHORT_PASSES = 2  # rows a lane in the short-row q8 id kernel (R of matvec_q8id_short_*)
PAD_FREE_ROWS = 32  # prefill: expert groups padded up to this many rows whatever the padding (see _groups)


def supported(type_name: str) -> bool:
    """Whether expert tensors of this type have id kernels (every quantized GPU type; float experts do not)."""
    k = GPU_KERNELS.get(type_name)
    return k is not None and not k.is_float


@dataclass(frozen=True)
class Router:
    """How a layer picks and weighs its experts on the device (hybrid.model.arch.moe.Routing's fields, with the
    router's bias and the selection bias exp_probs_b as device float32 (n_expert,) arrays or None)."""

    n_used: int
    norm: bool  # the selected weights renormalized to sum 1
    gating: str = "softmax"  # a key of GATINGS ("softmax_weight": top k of the logits, weights their softmax)
    scale: float = 1.0
    n_groups: int = 1  # > 1: the top n_group_used groups first (a group scores the sum of its two best)
    n_group_used: int = 0
    bias: object = None  # added to the logits (gpt-oss)
    sel_bias: object = None  # added to the probabilities for the selection only
    done: object = None  # a zeroed device uint32 (1,) of this layer's: router_route's count of finished CTAs

    @property
    def plain(self) -> bool:
        """Plain softmax top-k (moe_route_softmax)."""
        return (self.gating == "softmax" and self.scale == 1.0 and self.n_groups <= 1 and self.bias is None
                and self.sel_bias is None)

    def why_not(self, n_expert: int) -> str:
        """"" when the device kernels route this for n_expert experts, else why not."""
        if not (0 < self.n_used <= n_expert <= MOE_MAX_EXPERTS and self.n_used <= MOE_MAX_K):
            return (f"need 0 < n_used <= {MOE_MAX_K}, n_used <= n_expert <= {MOE_MAX_EXPERTS}, found {self.n_used}, "
                    f"{n_expert}")
        if self.gating not in GATINGS:
            return f"unknown gating {self.gating!r}"
        if self.n_groups > 1 and (self.n_groups > MOE_MAX_GROUPS or n_expert % self.n_groups
                                  or not 0 < self.n_group_used <= self.n_groups):
            return (f"{self.n_groups} groups ({self.n_group_used} used) of {n_expert} experts: need at most "
                    f"{MOE_MAX_GROUPS} groups of equal size")
        return ""


def route(logits, n_used: int, norm: bool):
    """logits cupy float32 (n_tok, n_expert) -> (ids int32 (n_tok, n_used), weights float32 (n_tok, n_used)):
    softmax, the top n_used (ties: the lower expert), renormalized to sum 1 when `norm` (as blocks.route)."""
    return route_with(logits, Router(n_used, norm))


def route_with(logits, r: Router):
    """logits cupy float32 (n_tok, n_expert) -> (ids int32 (n_tok, k), weights float32 (n_tok, k)) as r says:
    moe_route_softmax for plain softmax, moe_route_gated for the rest (as hybrid.model.arch.moe.route_gated)."""
    import cupy  # noqa: PLC0415

    n_tok, n_expert = logits.shape
    why = r.why_not(n_expert)
    if why:
        raise ValueError(f"moe route: {why}")
    ids = cupy.empty((n_tok, r.n_used), dtype=cupy.int32)
    wts = cupy.empty((n_tok, r.n_used), dtype=cupy.float32)
    if not n_tok:
        return ids, wts
    logits = cupy.ascontiguousarray(logits)
    i32 = np.int32
    if r.plain:
        get_kernel("moe", "moe_route_softmax")((n_tok,), (MOE_ROUTE_THREADS,), (logits, i32(n_expert), i32(r.n_used),
                                                                                i32(bool(r.norm)), ids, wts))
        return ids, wts
    null = np.uint64(0)
    bias, sel = (null if b is None else _f32_vector(b, n_expert) for b in (r.bias, r.sel_bias))
    get_kernel("moe", "moe_route_gated")((n_tok,), (MOE_ROUTE_THREADS,), (
        logits, bias, sel, i32(n_expert), i32(r.n_used), i32(GATINGS[r.gating]), i32(bool(r.norm)),
        np.float32(r.scale), i32(max(1, r.n_groups)), i32(r.n_group_used), ids, wts))
    return ids, wts


def router_route(x, router: tuple, r: Router, q8: bool):
    """A decode token's router matvec, routing and (q8) the quantize_q8_1 of x in one launch (moe_router_route), or
    None where that kernel does not apply (then the router's matmul and route_with): x cupy float32 (1, n_in),
    router (raw, type) of an F32 router with rows of whole 16-byte chunks, r with a `done` counter. Returns (ids
    (1, k) int32, weights (1, k) float32, (xq, xm) or None). The logits are summed as matmul's matvec_f32_1 sums
    them (the same wpr), so the routing equals the two-launch path's."""
    import cupy  # noqa: PLC0415

    w, type_name = router
    n_expert, row_bytes = w.shape
    n_in = row_bytes // 4
    if (type_name != "F32" or r.done is None or x.shape != (1, n_in) or row_bytes % 32 or w.data.ptr % 16
            or x.data.ptr % 16 or (q8 and n_in % Q8_BLOCK) or r.why_not(n_expert)):
        return None
    wpr = float_wpr(n_expert, n_in)
    logits = cupy.empty((1, n_expert), dtype=cupy.float32)
    ids = cupy.empty((1, r.n_used), dtype=cupy.int32)
    wts = cupy.empty((1, r.n_used), dtype=cupy.float32)
    xq, xm = q8_empty(1, n_in) if q8 else (np.uint64(0), np.uint64(0))
    i32, null = np.int32, np.uint64(0)
    bias, sel = (null if b is None else _f32_vector(b, n_expert) for b in (r.bias, r.sel_bias))
    ctas = -(-n_expert // (MV_WARPS // wpr))
    get_kernel("moe", "moe_router_route")((ctas,), (MV_WARPS * 32,), (
        w, x, logits, i32(n_expert), i32(n_in), i32(wpr), i32(r.plain), bias, sel, i32(r.n_used),
        i32(GATINGS[r.gating]), i32(bool(r.norm)), np.float32(r.scale), i32(max(1, r.n_groups)), i32(r.n_group_used),
        ids, wts, xq, xm, r.done))
    return ids, wts, ((xq, xm) if q8 else None)


def _f32_vector(b, n: int):
    if b.dtype != np.float32 or b.size != n or not b.flags.c_contiguous:
        raise ValueError(f"moe route: a bias must be {n} contiguous float32 values, found {b.dtype} {b.shape}")
    return b


def add_bias(y, bias, experts) -> None:
    """y (n_rows, n) f32 += bias[experts[r]] per row (bias (n_expert, n) f32; experts int32 (n_rows,), -1 leaves a
    row as it is), in place."""
    n_rows, n = y.shape
    if bias.shape[1:] != (n,) or bias.dtype != np.float32:
        raise ValueError(f"moe bias: expected float32 rows of {n}, found {bias.dtype} {bias.shape}")
    total = n_rows * n
    if total:
        get_kernel("moe", "moe_add_bias")(((total + 255) // 256,), (256,), (y, bias, experts, np.int32(n_rows),
                                                                              np.int32(n)))


def combine(y, wts, n_tok: int, rows=None, residual=None):
    """out (n_tok, n) = residual + sum_j wts[t, j] * y[rows[t k + j]] (rows None: slot t k + j; residual None: the
    sum alone; else float32 (n_tok, n) on the device, C-contiguous)."""
    import cupy  # noqa: PLC0415

    n = y.shape[-1]
    k = wts.shape[1]
    out = cupy.empty((n_tok, n), dtype=cupy.float32)
    total = n_tok * n
    if residual is not None and (residual.shape != (n_tok, n) or residual.dtype != np.float32
                                 or not residual.flags.c_contiguous):
        raise ValueError(f"moe combine: the residual must be float32 ({n_tok}, {n}) contiguous, found "
                         f"{residual.dtype} {residual.shape}")
    if total:
        null = np.uint64(0)
        get_kernel("moe", "moe_combine")(((total + 255) // 256,), (256,), (
            y, null if rows is None else rows, wts, null if residual is None else residual, out, np.int32(n_tok),
            np.int32(k), np.int32(n)))
    return out


def _expert_dims(raw, type_name: str) -> tuple[int, int, int, int]:
    """(n_expert, n_out, n_in, bytes an expert) of a raw 3-D expert tensor on the device."""
    k = gpu_kernel(type_name)
    n_expert, n_out, row_bytes = raw.shape
    if row_bytes % k.type_size:
        raise ValueError(f"expert rows of {row_bytes} bytes are not whole {type_name} blocks")
    if raw.data.ptr % k.align or (n_out * row_bytes) % k.align:
        raise ValueError(f"expert tensor of {type_name} must be {k.align}-byte aligned per expert on the device")
    return int(n_expert), int(n_out), row_bytes // k.type_size * k.block_size, int(n_out * row_bytes)


def id_matvec(ws: list, type_name: str, x, ids, x_div: int, q8_act=None) -> list:
    """For each slot s of ids (flat int32 (n_slots,)): y_i[s] = W_i[ids[s]] x[s // x_div], for 1 or 2 expert
    tensors ws of one type and shape (gate and up in one launch). x cupy float32 (rows, n_in); q8_act: x already
    quantized (quantize_q8_1). Returns one (n_slots, n_out) float32 array per tensor."""
    import cupy  # noqa: PLC0415

    assert 1 <= len(ws) <= 2
    k = gpu_kernel(type_name)
    _, n_out, n_in, expert_bytes = _expert_dims(ws[0], type_name)
    n_slots = int(ids.shape[0])
    ys = [cupy.empty((n_slots, n_out), dtype=cupy.float32) for _ in ws]
    if n_slots == 0 or n_out == 0:
        return ys
    n_blocks = n_in // k.block_size
    i32, i64 = np.int32, np.int64
    if type_name in Q8_MATVEC:
        xq, xm = quantize_q8_1(x) if q8_act is None else q8_act
        staged = Q8_KERNEL[type_name] == "staged"
        rpw = 2
        items = n_blocks * Q8_MATVEC[type_name]
        w1, y1 = (ws[1], ys[1]) if len(ws) == 2 else (ws[0], ys[0])
        if items <= 32 and not staged:  # short rows: several rows a warp (matvec_q8_short_body; measured on the
            # H200, an expert's down projection of 768 inputs: Q4_K 1278 GB/s vs 905 with matvec_q8id; Q6_K 704 vs
            # 846 with the staged kernel, which keeps it)
            ctas = -(-n_out // (MV_WARPS * (32 // items) * SHORT_PASSES))
            fn = get_kernel("matvec_q8", f"matvec_q8id_short_{k.suffix}_r{SHORT_PASSES}")
            fn((ctas, n_slots, len(ws)), (MV_WARPS * 32,), (ws[0], w1, ys[0], y1, ids, i64(expert_bytes), i32(n_out),
                                                           xq, xm, i32(x_div), i32(n_blocks), i32(1)))
            return ys
        if staged:
            warps = Q6S_WARPS
            wpr = 1 if n_blocks <= Q6S_NB else min(Q6S_WARPS, 4 if n_blocks >= 32 else 2)
            fn = get_kernel("matvec_q8", f"matvec_q8sid_{k.suffix}_r{rpw}")
        else:
            warps = MV_WARPS
            wpr = q8_config(n_out, n_blocks * Q8_MATVEC[type_name], rpw)[1]
            fn = get_kernel("matvec_q8", f"matvec_q8id_{k.suffix}_r{rpw}")
        ctas = -(-(-(-n_out // rpw)) // (warps // wpr))
        fn((ctas, n_slots, len(ws)), (warps * 32,), (ws[0], w1, ys[0], y1, ids, i64(expert_bytes), i32(n_out), xq, xm,
                                                     i32(x_div), i32(n_blocks), i32(wpr)))
        return ys
    rpw, wpr = matvec_config(n_out, n_blocks * k.parts, 2)
    ctas = -(-(-(-n_out // rpw)) // (MV_WARPS // wpr))
    fn = get_kernel(k.module, f"matvec_id_{k.suffix}_1r2")
    for w, y in zip(ws, ys):
        fn((ctas, n_slots), (MV_WARPS * 32,), (w, ids, i64(expert_bytes), x, i32(x_div), y, i32(n_out),
                                               i32(n_blocks), i32(wpr)))
    return ys


def _decode(h, ids, wts, gate, up, down, act: str, biases: tuple = (None, None, None), q8_act=None,
            residual=None):
    n_tok, n_used = ids.shape
    flat = ids.reshape(-1)
    bg, bu, bd = biases
    if gate[1] == up[1] and gate[0].shape == up[0].shape:
        g, u = id_matvec([gate[0], up[0]], gate[1], h, flat, n_used, q8_act)
    else:
        (g,), (u,) = (id_matvec([w[0]], w[1], h, flat, n_used, q8_act) for w in (gate, up))
    for y, b in ((g, bg), (u, bu)):
        if b is not None:
            add_bias(y, b, flat)
    if down[1] in Q8_MATVEC:  # the GLU and the q8 quantization of its output in one kernel
        (d,) = id_matvec([down[0]], down[1], None, flat, 1, q8_act=_glu_q8(g, u, act))
    else:
        (d,) = id_matvec([down[0]], down[1], glu(g, u, act), flat, 1)
    if bd is not None:
        add_bias(d, bd, flat)
    return combine(d, wts, n_tok, residual=residual)


def _glu_q8(g, u, act: str) -> tuple:
    """quantize_q8_1(glu(g, u, act)) in one kernel (moe_glu_q8): g, u cupy float32 (rows, n), n % 32 == 0."""
    n_rows, n = g.shape
    total = n_rows * n
    xq, xm = q8_empty(n_rows, n)
    if total:
        get_kernel("moe", "moe_glu_q8")(((total + 255) // 256,), (256,), (g, u, np.int32(GLU_ACTS[act]), xq, xm,
                                                                          np.int32(total)))
    return xq, xm


def _bucket(m: int) -> int:
    """A run's padded group size: m rounded up to a multiple of 8 up to 32, then to a quarter of its power of two
    (at most +25%), so that the batched GEMMs of random batches take few shapes (cuBLAS chooses an algorithm per new
    shape, ~30 us a time: thousands of shapes a prefill batch otherwise)."""
    if m <= 32:
        return -(-m // 8) * 8
    step = 1 << (m.bit_length() - 3)  # 33..64 -> 8, 65..128 -> 16, ...
    return -(-m // step) * step


def _groups(ids_host: np.ndarray, max_run: int) -> tuple[list[tuple[int, int, int, int]], np.ndarray, np.ndarray]:
    """The (token, slot) pairs of ids (n_tok, k) grouped by expert for batched GEMMs: (runs, src, dest).

    A run is up to max_run consecutive experts that starts and ends with an expert that has tokens; its groups
    are padded to its largest size m, rounded up by _bucket (unused experts inside it are groups of padding only:
    dequantizing one costs less than the launches of another run), and it ends before an expert that would make
    the padded rows more than twice the real ones with m above PAD_FREE_ROWS (small groups pad for free: a GEMM
    of so few rows costs its weight reads). Its experts' weights are one contiguous slice. runs: (first expert, end expert, m, first row) each; src (rows,): the token
    of each row, -1 for padding; dest (n_tok k,): each pair's row."""
    flat = ids_host.reshape(-1)
    k = ids_host.shape[1]
    counts = np.bincount(flat).tolist()  # plain ints: the walk below is Python
    n = len(counts)
    runs, row, e = [], 0, 0
    first_row = np.zeros(n, dtype=np.int64)  # of each expert's group
    while e < n:
        if counts[e] == 0:
            e += 1
            continue
        hi = total = counts[e]
        e1 = last = e + 1  # last: the end of the run's used experts (a run never ends with an unused one)
        while e1 < n and e1 - e < max_run:
            c = counts[e1]
            m = max(hi, c)
            if m > PAD_FREE_ROWS and m * (e1 - e + 1) > 2 * (total + c):
                break
            hi, total = m, total + c
            e1 += 1
            if c:
                last = e1
        e1 = last
        hi = _bucket(hi)
        first_row[e:e1] = np.arange(row, row + hi * (e1 - e), hi)
        runs.append((e, e1, hi, row))
        row += hi * (e1 - e)
        e = e1
    # pairs by expert, tokens ascending within (int16: numpy's stable sort is then a radix sort)
    order = np.argsort(flat.astype(np.int16 if n <= 32768 else np.int64), kind="stable")
    sorted_e = flat[order]
    starts = np.cumsum(counts) - counts  # each expert's first place in the sorted pairs
    rows = first_row[sorted_e] + (np.arange(flat.size) - starts[sorted_e])  # + the pair's place in its group
    src = np.full(row, -1, dtype=np.int32)
    src[rows] = order // k
    dest = np.empty(flat.size, dtype=np.int32)
    dest[order] = rows
    return runs, src, dest


class _BatchedGemm:
    """Strided-batched fp16 GEMMs on cuBLAS with fp32 accumulation and output, the handle set up once for a whole
    projection's runs (per call, only the GEMM itself: a prefill of skewed routing has dozens of runs a layer)."""

    def __enter__(self):
        import cupy  # noqa: PLC0415
        from cupy_backends.cuda.libs import cublas  # noqa: PLC0415

        self._cublas = cublas
        self._handle = cupy.cuda.device.get_cublas_handle()
        cublas.setStream(self._handle, cupy.cuda.get_current_stream().ptr)
        self._mode = cublas.getPointerMode(self._handle)
        cublas.setPointerMode(self._handle, cublas.CUBLAS_POINTER_MODE_HOST)
        self._one, self._zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        self._r16, self._r32 = cupy.cuda.runtime.CUDA_R_16F, cupy.cuda.runtime.CUDA_R_32F
        return self

    def __call__(self, w16, x16, y, n_batch: int, m: int, n_out: int, n_in: int) -> None:
        """y[b] (m, n_out) = x16[b] (m, n_in) @ w16[b].T (n_out, n_in) for b < n_batch (device pointers' arrays)."""
        cb = self._cublas
        cb.gemmStridedBatchedEx(self._handle, cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, n_out, m, n_in,
                                self._one.ctypes.data, w16.data.ptr, self._r16, n_in, n_out * n_in,
                                x16.data.ptr, self._r16, n_in, m * n_in,
                                self._zero.ctypes.data, y.data.ptr, self._r32, n_out, m * n_out,
                                n_batch, cb.CUBLAS_COMPUTE_32F, cb.CUBLAS_GEMM_DEFAULT)

    def __exit__(self, *exc) -> None:
        self._cublas.setPointerMode(self._handle, self._mode)


def _gather_f16(x, src):
    import cupy  # noqa: PLC0415

    n = x.shape[1]
    out = cupy.empty((src.shape[0], n), dtype=cupy.float16)
    total = out.size
    if total:
        get_kernel("moe", "moe_gather_f16")(((total + 255) // 256,), (256,), (x, src, out, np.int32(src.shape[0]),
                                                                              np.int32(n)))
    return out


def resident_experts(raw, type_name: str):
    """The dequantizer of experts on the device: f(e0, e1, out fp16 ((e1 - e0) n_out, n_in)) writes experts
    [e0, e1)."""
    n_expert, n_out, n_in, expert_bytes = _expert_dims(raw, type_name)
    k = gpu_kernel(type_name)
    fn = get_kernel(k.module, f"dequant_f16_{k.suffix}")  # dequantize()'s kernel, its checks made once here
    n_blocks, base, no_rows = n_in // k.block_size, raw.data.ptr, np.uint64(0)

    def dequant(e0: int, e1: int, out) -> None:
        n_rows = (e1 - e0) * n_out
        assert out.shape == (n_rows, n_in) and out.dtype == np.float16 and out.flags.c_contiguous
        total = n_rows * n_blocks * k.parts
        fn(((total + 255) // 256,), (256,), (np.uint64(base + e0 * expert_bytes), no_rows, out, np.int32(n_rows),
                                             np.int32(n_blocks)))

    return dequant


def max_run(shapes: tuple) -> int:
    """Experts one dequantized fp16 chunk holds (GEMM_CHUNK_ELEMENTS) for the largest of the projections."""
    return max(1, GEMM_CHUNK_ELEMENTS // max(1, max(n_out * n_in for n_out, n_in in shapes)))


def _grouped(x16, runs: list, n_rows: int, shape: tuple[int, int], dequant) -> object:
    """(n_rows, n_out) f32: each run's groups of x16 (n_rows, n_in) fp16 rows times their experts, one
    strided-batched GEMM a run on its experts dequantized to fp16 (dequant(e0, e1, out)); padding rows give 0."""
    import cupy  # noqa: PLC0415

    n_out, n_in = shape
    y = cupy.empty((n_rows, n_out), dtype=cupy.float32)
    scratch = cupy.empty((max(e1 - e0 for e0, e1, _, _ in runs) * n_out, n_in), dtype=cupy.float16)
    with _BatchedGemm() as gemm:
        for e0, e1, m, row in runs:
            w16 = scratch[:(e1 - e0) * n_out]
            dequant(e0, e1, w16)
            gemm(w16, x16[row:], y[row:], e1 - e0, m, n_out, n_in)
    return y


def prefill(h, ids, wts, shapes: tuple, dequants: tuple, act: str, prefetch=None, biases: tuple = (None, None, None)):
    """The experts of routed tokens (ids, wts from route) for a batch: shapes the (n_out, n_in) of gate, up and
    down, dequants their dequantizers (resident_experts, or one that uploads experts from host memory first),
    called for gate's runs, then up's, then down's, each in `runs` order; prefetch(runs), when given, hears the
    runs [(first expert, end expert, rows, first row)] before any dequantizer is called; biases, optionally, each
    projection's bias rows (n_expert, n_out) f32 on the device, added to its rows."""
    import cupy  # noqa: PLC0415

    n_tok = h.shape[0]
    # the one host synchronization: the group sizes set the GEMM shapes; then one upload of the row maps
    runs, src, dest = _groups(cupy.asnumpy(ids), max_run(shapes))
    if prefetch is not None:
        prefetch(runs)
    n_rows = src.shape[0]
    biased = any(b is not None for b in biases)
    maps = cupy.asarray(np.concatenate([src, dest] + ([_row_experts(runs, n_rows)] if biased else [])))
    x16 = _gather_f16(h, maps[:n_rows])  # (n_rows, n_embd)
    row_e = maps[n_rows + dest.shape[0]:]
    g = _grouped(x16, runs, n_rows, shapes[0], dequants[0])
    u = _grouped(x16, runs, n_rows, shapes[1], dequants[1])
    for y, b in zip((g, u), biases):
        if b is not None:
            add_bias(y, b, row_e)
    a16 = glu(g, u, act).astype(cupy.float16)  # padding rows are never read back (combine takes dest's rows)
    del g, u, x16
    d = _grouped(a16, runs, n_rows, shapes[2], dequants[2])  # (n_rows, n_embd)
    if biases[2] is not None:
        add_bias(d, biases[2], row_e)
    return combine(d, wts, n_tok, rows=maps[n_rows:n_rows + dest.shape[0]])


def _row_experts(runs: list, n_rows: int) -> np.ndarray:
    """The expert of every row of the grouped layout (padding rows of a group count as its expert's), int32."""
    e = np.full(n_rows, -1, dtype=np.int32)
    for e0, e1, m, row in runs:
        e[row:row + (e1 - e0) * m] = np.repeat(np.arange(e0, e1, dtype=np.int32), m)
    return e


MM_BM, MM_BN, MM_LD, MM_THREADS = 64, 64, 264, 256  # moe_mma.cu's tile rows and columns, smem row, threads
MMA_DEFINES = (("MOE_MMA", 1),)  # the build of a type's module that holds its moe_mma entries


def mma_why_not(gate: tuple, up: tuple, down: tuple) -> str:
    """"" when prefill_mma runs these experts ((raw, type) each), else why not: gate and up of one type and
    shape, every type a quantized GPU type, even output sizes and inputs in whole 32-element groups."""
    if gate[1] != up[1] or gate[0].shape != up[0].shape:
        return f"gate and up differ ({gate[1]} {gate[0].shape}, {up[1]} {up[0].shape})"
    for raw, type_name in (gate, down):
        if not supported(type_name):
            return f"no GPU kernels for experts of {type_name}"
        _, n_out, n_in, _ = _expert_dims(raw, type_name)
        if n_out % 2 or n_in % 32:
            return f"expert of {n_out} x {n_in}: need an even output size and inputs a multiple of 32"
    return ""


def group(ids, n_expert: int) -> tuple:
    """The (token, slot) pairs of ids (cupy int32 (n_tok, k)) grouped by expert on the device (moe_group, one CTA,
    no host synchronization): (tiles int32 (max_tiles, 4) = (expert, first row, rows <= MM_BM, 0), n_tiles int32
    (1,): how many of them are real, src int32 (pairs,): each row's token, dest int32 (pairs,): each pair's row).
    max_tiles, the most there can be, sizes the GEMMs' grids."""
    import cupy  # noqa: PLC0415

    n_tok, k = ids.shape
    n_pairs = n_tok * k
    if not 0 < n_expert <= MOE_MAX_EXPERTS:
        raise ValueError(f"moe group: need 0 < n_expert <= {MOE_MAX_EXPERTS}, found {n_expert}")
    max_tiles = n_pairs // MM_BM + min(n_expert, n_pairs)  # ceil(c / MM_BM) <= c // MM_BM + 1 for a used expert
    buf = cupy.empty(4 * max_tiles + 1 + 2 * n_pairs, dtype=cupy.int32)
    tiles, n_tiles = buf[:4 * max_tiles].reshape(max_tiles, 4), buf[4 * max_tiles:4 * max_tiles + 1]
    src, dest = buf[4 * max_tiles + 1:4 * max_tiles + 1 + n_pairs], buf[4 * max_tiles + 1 + n_pairs:]
    i32 = np.int32
    get_kernel("moe", "moe_group")((1,), (1024,), (cupy.ascontiguousarray(ids, dtype=cupy.int32), i32(n_pairs),
                                                    i32(k), i32(n_expert), i32(MM_BM), tiles, n_tiles, src, dest))
    return tiles, n_tiles, src, dest


def _mma_kernel(type_name: str, glu_: bool):
    """moe_mma_glu_<t> (gate and up) or moe_mma_<t> (one projection), with its dynamic shared memory (bytes)."""
    k = gpu_kernel(type_name)
    fn = get_kernel(k.module, f"moe_mma{'_glu' if glu_ else ''}_{k.suffix}", MMA_DEFINES)
    smem = (MM_BM + (2 if glu_ else 1) * MM_BN) * MM_LD * 2
    if fn.max_dynamic_shared_size_bytes < smem:  # past 48 KiB needs the opt-in attribute
        fn.max_dynamic_shared_size_bytes = smem
    return fn, smem


def prefill_mma(h, ids, wts, gate: tuple, up: tuple, down: tuple, act: str, biases: tuple = (None, None, None),
                residual=None):
    """The experts of routed tokens (ids, wts from route) for a batch, on the tensor cores (moe_mma.cu): the pairs
    grouped by expert on the device (group), then one launch for gate and up with the GLU (fp16 out), one for down
    (float32 out) and moe_combine; no host synchronization (a prefill batch can be one CUDA graph). The experts
    stay quantized: each CTA dequantizes its tile's blocks into shared memory. gate/up/down are (raw on the device,
    type) with mma_why_not(...) == ""; biases each projection's (n_expert, n_out) f32 rows or None."""
    import cupy  # noqa: PLC0415

    n_tok = h.shape[0]
    h = cupy.ascontiguousarray(h, dtype=cupy.float32)
    n_expert, n_ff, n_embd, eb_gate = _expert_dims(*gate)
    _, n_out, n_in, eb_down = _expert_dims(*down)
    tiles, n_tiles, src, dest = group(ids, n_expert)
    max_tiles, n_rows = tiles.shape[0], src.shape[0]
    i32, i64, null = np.int32, np.int64, np.uint64(0)
    bg, bu, bd = (null if b is None else cupy.ascontiguousarray(b, dtype=cupy.float32) for b in biases)
    a16 = cupy.empty((n_rows, n_ff), dtype=cupy.float16)
    y = cupy.empty((n_rows, n_out), dtype=cupy.float32)
    if max_tiles:
        fn, smem = _mma_kernel(gate[1], True)
        fn((-(-n_ff // MM_BN), max_tiles), (MM_THREADS,), (gate[0], up[0], i64(eb_gate), tiles, n_tiles, h, src,
                                                           i32(n_embd), i32(n_ff), bg, bu, i32(GLU_ACTS[act]), a16),
           shared_mem=smem)
        fn, smem = _mma_kernel(down[1], False)
        fn((-(-n_out // MM_BN), max_tiles), (MM_THREADS,), (down[0], i64(eb_down), tiles, n_tiles, a16, i32(n_in),
                                                            i32(n_out), bd, y), shared_mem=smem)
    return combine(y, wts, n_tok, rows=dest, residual=residual)


def moe_ffn(h, router: tuple, gate: tuple, up: tuple, down: tuple, routing: Router, act: str, on_route=None,
            biases: tuple = (None, None, None), residual=None, q8_act=None):
    """The MoE FFN of h (see the module docstring); every weight a (raw on the device, GGML type) pair, biases the
    experts' bias rows of gate, up and down (float32 (n_expert, n_out) on the device) or None. on_route, when
    given, is called with the routing (ids int32, weights float32, both cupy (n_tok, n_used)) before the experts
    run (a routing trace: it may copy them to the host). residual: when given ((n_tok, n_embd) on the device), the
    result is residual + the FFN (added in the weighted sum's kernel). q8_act: a decode batch's h already quantized
    (quantize_q8_1's (xq, xm)), for the experts' q8 matvecs."""
    import cupy  # noqa: PLC0415

    h = cupy.ascontiguousarray(h, dtype=cupy.float32)
    for w in (gate, up, down):
        if not supported(w[1]):
            raise ValueError(f"no MoE kernels for expert tensors of {w[1]}")
    if act not in GLU_ACTS:
        raise ValueError(f"no MoE GLU {act!r}: expected one of {', '.join(GLU_ACTS)}")
    if residual is not None:
        residual = cupy.ascontiguousarray(residual, dtype=cupy.float32)
    q8 = q8_act is None and gate[1] in Q8_MATVEC
    fused = router_route(h, router, routing, q8) if h.shape[0] == 1 else None
    if fused is not None:  # one token: router, routing and (q8) the experts' q8 input in one launch
        ids, wts, q8_fused = fused
        q8_act = q8_act if q8_fused is None else q8_fused
    else:
        ids, wts = route_with(matmul(router[0], router[1], h), routing)  # logits (n_tok, n_expert) between
    if on_route is not None:
        on_route(ids, wts)
    if h.shape[0] <= MATVEC_MAX_TOKENS:
        return _decode(h, ids, wts, gate, up, down, act, biases, q8_act, residual)
    if not mma_why_not(gate, up, down):
        return prefill_mma(h, ids, wts, gate, up, down, act, biases, residual)
    shapes = tuple(_expert_dims(*w)[1:3] for w in (gate, up, down))  # gate and up of two types: dequant + cuBLAS
    out = prefill(h, ids, wts, shapes, tuple(resident_experts(*w) for w in (gate, up, down)), act, biases=biases)
    return out if residual is None else out + residual
