"""`matmul(w_raw, type_name, x)` on the GPU, weights kept in their raw GGML blocks in device memory.

Decode (n_tok <= MATVEC_MAX_TOKENS): one matvec kernel per type reads the blocks once, dequantizes in registers
and serves up to 8 tokens (warp-per-row, shuffle reductions). A Q8_MATVEC type (MATVEC_Q8, or the `q8` argument):
the activations are quantized to 8 bits per 32 (quantize_q8_1) and dotted by dp4a (matvec_q8.cu), one token or,
through matvec_q8t, up to 8 (the weights loaded once for all of them: a decode batch of several sequences).
9 to MMQ_MAX_TOKENS tokens of a Q8T_MMA_TYPES weight (a prompt chunk beside decoding sequences): the tensor-core kernel
of matvec_mmq.cu (Q4_K) or matvec_mmq_q6k.cu (Q6_K) on q8 activations, the weight read once in its blocks
(matmul_mmq).
Prefill: the weight is dequantized in row chunks into an fp16 scratch, and cuBLAS multiplies fp16 x fp16 with fp32
accumulation and fp32 output (F32 weights: fp32 GEMM on the raw rows; BF16: an fp32 scratch). One explicit
`GPU_KERNELS` entry per GGML type. `matmul_many` multiplies one x by several weights (q/k/v, gate/up): one q8
launch over all rows of a type, or for prefill one fp16 x and (up to GEMM_STACK_ELEMENTS) one stacked GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gguf_io.errors import UnsupportedQuantType

from .module import get_kernel

MATVEC_MAX_TOKENS = 8  # tokens one matvec launch serves (NT templates 1, 2, 4, 8)
GEMM_MIN_TOKENS = 9  # from here on dequantize + cuBLAS (measured: equal to the matvec at 8 tokens, 2x ahead at 16)
MMQ_MAX_TOKENS = 64  # up to here a Q8T_MMA_TYPES weight takes the tensor-core kernel (matmul_mmq) instead of the GEMM
GEMM_CHUNK_ELEMENTS = 1 << 26  # dequantized scratch per chunk: 64 Mi values = 128 MiB of fp16
MV_WARPS = 8  # warps per CTA in the matvec kernels (MV_WARPS / MVF_WARPS in the .cu files)
MATVEC_Q8 = True  # default of matmul(q8=None): one-token matvecs of Q8_AUTO types on q8 activations + dp4a
Q8_MATVEC: dict[str, int] = {"Q4_K": 4, "Q6_K": 4}  # type -> parts a block (threads) in matvec_q8.cu
# The types whose one-token matvec takes the q8 path by default: measured on the H200 (scripts/gpu_matvec_check.py,
# scripts/gpu_fused_check.py, weights beyond L2), Q4_K's q8 kernel streams 1.5-2.2x faster than the float one on
# 4096- to 14336-row matrices; Q6_K's staged q8 kernel 1.15-1.4x on 4096x14336 and 1.27x on 14336x4096 (0.91x on
# 1024x4096, a few microseconds a token).
Q8_AUTO = frozenset({"Q4_K", "Q6_K"})
Q8_BLOCK = 32  # activations per q8 scale
# The q8 kernel design per type (matvec_q8's `kernel`): "warp" = matvec_q8.cu (each lane loads its part of a block in
# place), "staged" = matvec_q8_staged.cu (a warp copies 8 whole blocks a row to shared memory with 16-byte
# cp.async; for block_q6_K, whose 210-byte blocks are only 2-byte aligned).
Q8_KERNEL: dict[str, str] = {"Q4_K": "warp", "Q6_K": "staged"}
Q8_STAGED = frozenset({"Q6_K"})  # the types with a "staged" kernel
Q6S_WARPS = 4  # warps per CTA of the staged kernel (Q6S_WARPS in matvec_q8_staged.cu)
Q6S_NB = 8  # blocks per staged chunk (Q6S_NB)
Q8_MANY = 3  # matrices one q8 launch covers (w0..w2 in matvec_q8m_* / matvec_q8s_*)
# matmul_many's prefill stacks its quantized weights into one fp16 scratch and one GEMM while their n_out x n_in
# sum is at most this (q/k/v of Llama-8B: 6144 x 4096 = 25 Mi), else each weight has its own GEMM on the shared x16
GEMM_STACK_ELEMENTS = GEMM_CHUNK_ELEMENTS


@dataclass(frozen=True)
class GpuKernel:
    """How the GPU multiplies by one GGML type."""

    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    module: str  # kernels_gpu module holding matvec_<suffix>_<NT> and dequant_*_<suffix>
    suffix: str
    parts: int  # threads per block in the matvec/dequant kernels (P in the .cu structs); 0 for float types
    align: int  # byte alignment the kernels assume for the weight's base address

    @property
    def is_float(self) -> bool:
        return self.parts == 0


_L, _K, _I, _F = "matvec_legacy", "matvec_k", "matvec_iq", "matvec_float"
GPU_KERNELS: dict[str, GpuKernel] = {
    "F32": GpuKernel("F32", 1, 4, _F, "f32", 0, 4),
    "F16": GpuKernel("F16", 1, 2, _F, "f16", 0, 2),
    "BF16": GpuKernel("BF16", 1, 2, _F, "bf16", 0, 2),
    "Q4_0": GpuKernel("Q4_0", 32, 18, _L, "q4_0", 2, 2),
    "Q4_1": GpuKernel("Q4_1", 32, 20, _L, "q4_1", 2, 4),
    "Q5_0": GpuKernel("Q5_0", 32, 22, _L, "q5_0", 2, 2),
    "Q5_1": GpuKernel("Q5_1", 32, 24, _L, "q5_1", 2, 4),
    "Q8_0": GpuKernel("Q8_0", 32, 34, _L, "q8_0", 2, 2),
    "IQ4_NL": GpuKernel("IQ4_NL", 32, 18, _L, "iq4_nl", 2, 2),
    "Q2_K": GpuKernel("Q2_K", 256, 84, _K, "q2_k", 8, 4),
    "Q3_K": GpuKernel("Q3_K", 256, 110, _K, "q3_k", 8, 2),
    "Q4_K": GpuKernel("Q4_K", 256, 144, _K, "q4_k", 8, 16),
    "Q5_K": GpuKernel("Q5_K", 256, 176, _K, "q5_k", 8, 16),
    "Q6_K": GpuKernel("Q6_K", 256, 210, _K, "q6_k", 8, 2),
    "IQ4_XS": GpuKernel("IQ4_XS", 256, 136, _K, "iq4_xs", 8, 8),
    "MXFP4": GpuKernel("MXFP4", 32, 17, _L, "mxfp4", 2, 1),
    "IQ2_XXS": GpuKernel("IQ2_XXS", 256, 66, _I, "iq2_xxs", 8, 2),
    "IQ2_XS": GpuKernel("IQ2_XS", 256, 74, _I, "iq2_xs", 8, 2),
    "IQ2_S": GpuKernel("IQ2_S", 256, 82, _I, "iq2_s", 8, 2),
    "IQ3_XXS": GpuKernel("IQ3_XXS", 256, 98, _I, "iq3_xxs", 8, 2),
    "IQ3_S": GpuKernel("IQ3_S", 256, 110, _I, "iq3_s", 8, 2),
    "IQ1_S": GpuKernel("IQ1_S", 256, 50, _I, "iq1_s", 8, 2),
    "IQ1_M": GpuKernel("IQ1_M", 256, 56, _I, "iq1_m", 8, 2),
}


def gpu_kernel(type_name) -> GpuKernel:
    try:
        return GPU_KERNELS[type_name]
    except (KeyError, TypeError):
        raise UnsupportedQuantType(
            f"no GPU matmul kernel for GGML type {type_name!r}; supported: {', '.join(GPU_KERNELS)}"
        ) from None


def _check(name, a, dtype, ndims):
    import cupy  # noqa: PLC0415

    if not isinstance(a, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy array (on the GPU), got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
    if a.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")


def uses_q8t(type_name: str, n_tok: int, q8: bool | None = None) -> bool:
    """Whether matmul's matvec of 2..MATVEC_MAX_TOKENS tokens of `type_name` runs on 8-bit activations (matvec_q8t;
    q8: None = the default, as uses_q8's)."""
    if not 2 <= n_tok <= MATVEC_MAX_TOKENS or type_name not in Q8_MATVEC:
        return False
    return (MATVEC_Q8 and type_name in Q8_AUTO) if q8 is None else q8


def uses_q8(type_name: str, n_tok: int, q8: bool | None = None) -> bool:
    """Whether matmul's one-token matvec of `type_name` runs on 8-bit activations (q8: None = the default)."""
    if n_tok != 1 or type_name not in Q8_MATVEC:
        return False
    return (MATVEC_Q8 and type_name in Q8_AUTO) if q8 is None else q8


def uses_mmq(type_name: str, n_tok: int) -> bool:
    """Whether matmul of n_tok tokens (GEMM_MIN_TOKENS..MMQ_MAX_TOKENS: a prompt chunk beside decoding sequences, a
    short prompt) multiplies on the tensor cores from the quantized blocks (matmul_mmq) instead of dequantizing the
    weight for cuBLAS: the weight is read once, in its blocks, and no fp16 copy of it is written and read back."""
    return GEMM_MIN_TOKENS <= n_tok <= MMQ_MAX_TOKENS and type_name in Q8T_MMA_TYPES


def matmul(w_raw, type_name, x, out=None, path: str = "auto", wpr: int | None = None, rpw: int | None = None,
           q8: bool | None = None, q8_act: tuple | None = None):
    """y = x @ W.T with W kept in its raw GGML blocks on the GPU.

    w_raw: cupy uint8 (n_out, row_bytes), C-contiguous; x: cupy float32 (n_tok, n_in) or (n_in,);
    out: optional cupy float32 (n_tok, n_out) or (n_out,). Returns y float32 (n_tok, n_out) or (n_out,).
    path: "auto", "matvec" (chunks of 8 tokens), "mmq" (tensor cores on 8-bit activations, Q8T_MMA_TYPES, up to
    MMQ_MAX_TOKENS; auto takes it from GEMM_MIN_TOKENS, uses_mmq) or "gemm" (dequantize + cuBLAS); wpr: warps per row
    group, rpw: rows per warp (one-token matvec of quantized types); None picks them. q8: one token on a Q8_MATVEC type
    goes through 8-bit activations and dp4a (True) or float activations (False); None: MATVEC_Q8 for Q8_AUTO types.
    q8_act: x already quantized by quantize_q8_1 (xq, xm), for callers that multiply one x by several weights.
    """
    import cupy  # noqa: PLC0415

    k, n_out, n_in = _check_weight("w_raw", w_raw, type_name)
    _check("x", x, np.float32, (1, 2))
    x2 = _rows_of(x, n_in, type_name)  # (n_tok, n_in)
    n_tok = x2.shape[0]
    y_shape = (n_out,) if x.ndim == 1 else (n_tok, n_out)
    if out is None:
        out = cupy.empty(y_shape, dtype=cupy.float32)
    else:
        _check("out", out, np.float32, (x.ndim,))
        if out.shape != y_shape:
            raise ValueError(f"out has shape {out.shape}, expected {y_shape}")
    if n_out == 0 or n_tok == 0:
        return out
    y2 = out.reshape(n_tok, n_out)
    if path == "auto":
        path = "matvec" if n_tok < GEMM_MIN_TOKENS else "mmq" if uses_mmq(type_name, n_tok) else "gemm"
    if path == "mmq":
        xq, xm = quantize_q8_1(x2) if q8_act is None else q8_act
        matmul_mmq(w_raw, type_name, xq, xm, y2)
    elif path == "matvec" and uses_q8(type_name, n_tok, q8):
        xq, xm = quantize_q8_1(x2) if q8_act is None else q8_act
        matvec_q8(w_raw, type_name, xq, xm, y2, wpr, rpw)
    elif path == "matvec" and q8_act is None and (mw := _mma_route(type_name, n_out, n_tok, q8, wpr)):
        _mmq_launch(w_raw, k, quantize_q8_mma(x2), y2, n_out, n_in, n_tok, mw, q8t_rt(type_name, n_out))
    elif path == "matvec" and uses_q8t(type_name, n_tok, q8):
        xq, xm = quantize_q8_1(x2) if q8_act is None else q8_act
        matvec_q8t(w_raw, type_name, xq, xm, y2, wpr)
    elif path == "matvec":
        for s in range(0, n_tok, MATVEC_MAX_TOKENS):
            e = min(n_tok, s + MATVEC_MAX_TOKENS)
            _matvec(k, w_raw, x2[s:e], y2[s:e], n_in, wpr, rpw)
    elif path == "gemm":
        _gemm(k, w_raw, x2, y2, n_in)
    else:
        raise ValueError(f"path must be 'auto', 'matvec', 'mmq' or 'gemm', found {path!r}")
    return out


def _check_weight(name: str, w_raw, type_name) -> tuple[GpuKernel, int, int]:
    """(kernel, n_out, n_in) of a raw weight, after checking its dtype, shape, rows and alignment."""
    k = gpu_kernel(type_name)
    _check(name, w_raw, np.uint8, (2,))
    n_out, row_bytes = w_raw.shape
    if row_bytes == 0 or row_bytes % k.type_size:
        raise ValueError(f"{name} rows of {row_bytes} bytes are not whole {type_name} blocks of {k.type_size} bytes")
    if w_raw.data.ptr % k.align:
        raise ValueError(f"{name} of {type_name} must be {k.align}-byte aligned on the device")
    return k, int(n_out), row_bytes // k.type_size * k.block_size


def _rows_of(x, n_in: int, type_name: str):
    """x (checked float32, 1-D or 2-D) as (n_tok, n_in), 16-byte aligned (the kernels read x as float4)."""
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} features but the {type_name} weight rows hold {n_in}")
    x2 = x.reshape(-1, n_in)
    return x2.copy() if x2.data.ptr % 16 else x2


def matvec_config(n_out: int, items_per_row: int, rpw: int | None = None) -> tuple[int, int]:
    """(rows per warp, warps per row group) of the one-token quantized matvec, as measured best on an H200
    (scripts/gpu_check.py's sweep): 4 rows a warp for wide layers, 2 below 4096 rows; then enough warps per
    row group for ~8192 warps in flight, keeping >= 2 items a lane (>= 1 for narrow layers)."""
    if rpw is None:
        rpw = 4 if n_out >= 4096 else 2
    groups = -(-n_out // rpw)
    per_lane = 1 if groups < 1024 else 2
    wpr = 1
    while wpr < MV_WARPS and groups * wpr < 8192 and items_per_row >= 32 * per_lane * wpr * 2:
        wpr *= 2
    return rpw, wpr


def float_wpr(n_out: int, n_in: int) -> int:
    """Warps per row of the float matvec (matvec_float.cu) of n_out rows of n_in: as measured (2.6 - 3.7 TB/s), up
    to 16384 warps, >= 2 chunks of 8 values a lane."""
    wpr, items = 1, n_in // 8
    while wpr < MV_WARPS and n_out * wpr < 16384 and items >= 64 * wpr:
        wpr *= 2
    return wpr


def _matvec(k: GpuKernel, w_raw, x, y, n_in: int, wpr: int | None, rpw: int | None = None) -> None:
    n_tok = x.shape[0]
    n_out = w_raw.shape[0]
    if k.is_float:
        nt = 1 if n_tok == 1 else 2 if n_tok == 2 else 4 if n_tok <= 4 else 8
        name, rpw, auto_wpr = f"matvec_{k.suffix}_{nt}", 1, float_wpr(n_out, n_in)
    else:
        items = n_in // k.block_size * k.parts
        if n_tok == 1:
            rpw, auto_wpr = matvec_config(n_out, items, rpw)
            if rpw not in (1, 2, 4):
                raise ValueError(f"rpw must be 1, 2 or 4, found {rpw}")
            name = f"matvec_{k.suffix}_1r{rpw}"
        elif n_tok == 2:
            name, rpw = f"matvec_{k.suffix}_2", 2
            auto_wpr = matvec_config(n_out, items, 2)[1]
        else:
            name, rpw = f"matvec_{k.suffix}_{4 if n_tok <= 4 else 8}", 1
            auto_wpr = matvec_config(n_out, items, 1)[1]
    fn = get_kernel(k.module, name)
    n_groups = -(-n_out // rpw)
    wpr = auto_wpr if wpr is None else wpr
    if wpr not in (1, 2, 4, 8):
        raise ValueError(f"wpr must be 1, 2, 4 or 8, found {wpr}")
    per_cta = MV_WARPS // wpr  # row groups per CTA
    grid = (-(-n_groups // per_cta),)
    i32 = np.int32
    if k.is_float:
        vec = (n_in * k.type_size) % 16 == 0 and w_raw.data.ptr % 16 == 0
        fn(grid, (256,), (w_raw, x, y, i32(n_out), i32(n_in), i32(n_tok), i32(wpr), i32(vec)))
    else:
        fn(grid, (256,), (w_raw, x, y, i32(n_out), i32(n_in // k.block_size), i32(n_tok), i32(wpr)))


def quantize_q8_1(x):
    """8-bit activations on the GPU: x cupy float32 (n_tok, n) C-contiguous, n % 32 == 0 -> (xq, xm):
    xq cupy int8 (n_tok, n), xm cupy float32 (n_tok, n / 32, 4) = (d, sum q[0..15], sum q[16..31], 0) a block,
    with d = max|x| / 127 and q = rint(x / d) (0 for an all-zero block); as q8_1_reference. One buffer."""
    import cupy  # noqa: PLC0415

    _check("x", x, np.float32, (2,))
    n_tok, n = x.shape
    if n % Q8_BLOCK:
        raise ValueError(f"x rows of {n} values are not whole blocks of {Q8_BLOCK}")
    total = n_tok * n
    xq, xm = q8_empty(n_tok, n)
    if total:
        fn = get_kernel("matvec_q8", "quantize_q8_1")
        fn(((total + 255) // 256,), (256,), (x, xq, xm, np.int32(total)))
    return xq, xm


def q8_empty(n_rows: int, n: int) -> tuple:
    """Uninitialized 8-bit activations of n_rows rows of n values (n % 32 == 0) as quantize_q8_1 lays them out:
    (xq int8 (n_rows, n), xm float32 (n_rows, n / 32, 4)), one buffer, xm 16-byte aligned."""
    import cupy  # noqa: PLC0415

    total = n_rows * n
    q_bytes = -(-total // 16) * 16
    buf = cupy.empty(q_bytes + total // Q8_BLOCK * 16, dtype=cupy.uint8)
    return (buf[:total].view(cupy.int8).reshape(n_rows, n),
            buf[q_bytes:].view(cupy.float32).reshape(n_rows, n // Q8_BLOCK, 4))


def q8_1_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Numpy twin of quantize_q8_1 (bit-exact: float32 division, round half to even): x float32 (..., n) ->
    (q int8 (..., n), d float32 (..., n / 32)); the activations it stands for are q * d."""
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(*x.shape[:-1], -1, Q8_BLOCK)  # (..., n/32, 32)
    d = np.max(np.abs(b), axis=-1) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(b / d[..., None]), np.float32(0))
    return q.astype(np.int8).reshape(x.shape), d.astype(np.float32)


def q8_config(n_out: int, items_per_row: int, rpw: int | None = None) -> tuple[int, int]:
    """(rows per warp, warps per row group) of the q8 matvec, from the device sweep of scripts/gpu_matvec_check.py
    (H200, Q4_K): 2 rows a warp everywhere; one warp a row group from 4096 rows (2412-2577 GB/s on 14336x4096 and
    4096x14336, 1758 on 4096x4096), two below (1024x4096: 813 GB/s)."""
    if rpw is None:
        rpw = 2
    wpr = 1 if n_out >= 4096 else 2 if items_per_row >= 128 else 1
    return rpw, wpr


def q8s_config(n_out: int, n_blocks: int, rpw: int | None = None) -> tuple[int, int]:
    """(rows per warp, warps per row group) of the staged q8 kernel (matvec_q8_staged.cu), from the H200 sweep of
    scripts/gpu_fused_check.py (Q6_K): 4096x14336 best r2w4 (2162 GB/s; r2w2 1766), 14336x4096 r2w1 (2252),
    1024x4096 r2w2 (790): long rows (>= 32 blocks) take 4 warps a row group, short ones 1 from 4096 rows, else 2."""
    if rpw is None:
        rpw = 2
    wpr = 4 if n_blocks >= 32 else 1 if n_out >= 4096 else 2
    return rpw, min(wpr, Q6S_WARPS)


def _check_q8_act(xq, xm, n_in: int, lo: int = 1, hi: int = 1) -> int:
    """The token count of activations quantize_q8_1 made (xq int8 (n_tok, n_in), xm float32 (n_tok, n_in / 32, 4),
    16-byte aligned on the device), after checking it lies in [lo, hi]."""
    _check("xq", xq, np.int8, (2,))
    _check("xm", xm, np.float32, (3,))
    n_tok = xq.shape[0]
    if not lo <= n_tok <= hi or xq.shape != (n_tok, n_in) or xm.shape != (n_tok, n_in // Q8_BLOCK, 4):
        raise ValueError(f"q8 activations of {lo}..{hi} tokens of {n_in}: got xq {xq.shape}, xm {xm.shape}")
    if xq.data.ptr % 16 or xm.data.ptr % 16:
        raise ValueError("xq and xm must be 16-byte aligned on the device")
    return n_tok


def matvec_q8(w_raw, type_name, xq, xm, y, wpr: int | None = None, rpw: int | None = None,
              kernel: str | None = None) -> None:
    """y = W x on activations quantize_q8_1 made: w_raw cupy uint8 (n_out, row_bytes) of a Q8_MATVEC type,
    xq cupy int8 (1, n_in), xm cupy float32 (1, n_in / 32, 4), y cupy float32 (1, n_out) or (n_out,).
    kernel: "warp" or "staged" (Q8_STAGED types); None: Q8_KERNEL[type_name]."""
    if type_name not in Q8_MATVEC:
        raise ValueError(f"no q8 matvec for {type_name}; it has: {', '.join(Q8_MATVEC)}")
    _, n_out, n_in = _check_weight("w_raw", w_raw, type_name)
    _check_q8_act(xq, xm, n_in)
    _check("y", y, np.float32, (1, 2))
    if y.size != n_out:
        raise ValueError(f"q8 matvec of {n_out}x{n_in}: y has shape {y.shape}")
    _q8_launch([w_raw], type_name, xq, xm, [y], wpr, rpw, kernel)


# matvec_q8t's designs: dp4a (matvec_q8.cu), tensor cores on the activations repacked for them (matvec_mmq.cu)
Q8T_KERNELS = ("dp4a", "mma")
Q8T_MMA_TYPES = ("Q4_K", "Q6_K")  # the types with a tensor-core kernel (matvec_mmq.cu, matvec_mmq_q6k.cu)
Q6K_MMA_FROM = 2  # tokens from which a Q6_K matrix of 4096 rows or more takes the tensor cores in matvec_q8t
MMQ6_STAGES = 3  # blocks in flight a warp in the Q6_K tensor-core kernel (MMQ6_STAGES in matvec_mmq_q6k.cu), each
MMQ6_SLOT = 240  # 16 rows a row tile x this many bytes of shared memory (MMQ6_SLOT)


def q8t_config(type_name: str, n_out: int, n_tok: int, kernel: str | None = None, rpw: int | None = None,
               wpr: int | None = None) -> tuple[str, int, int]:
    """(kernel, rows per warp, warps per row group) of matvec_q8t for n_tok tokens; what is given is kept. The
    defaults come from the H200 sweep of scripts/gpu_q8t_check.py on Llama-8B's matrices: Q4_K from 4096 rows takes
    the tensor cores on repacked activations, 8 warps a row tile, from 5 tokens (from 4 at 8192 rows and more;
    8 tokens of 14336x4096: 1706 GB/s against dp4a's best 825), else dp4a with 4 rows a warp and 2 warps a row (4
    tokens: 1458 against 1148 for 2 rows and 1 warp); Q6_K from 4096 rows takes the tensor cores from 2 tokens
    (Q6K_MMA_FROM; 8 tokens of 128256x4096: 214 us against dp4a's 557, of 4096x14336 31 against 66); shorter matrices
    keep dp4a with 2 rows a warp (4 at 8 tokens), 1 warp a row from 4096 rows. The tensor-core kernels take 16 rows a
    warp (rpw is not used)."""
    big = n_out >= 4096
    if kernel is None:
        if type_name == "Q6_K":
            mma = big and n_tok >= Q6K_MMA_FROM
        else:
            mma = type_name in Q8T_MMA_TYPES and big and (n_tok >= 5 or (n_tok == 4 and n_out >= 8192))
        kernel = "mma" if mma else "dp4a"
    if rpw is None:
        rpw = 4 if big and (type_name == "Q4_K" or n_tok >= 5) else 2
    if wpr is None:
        if kernel == "mma":
            wpr = 8
        else:
            wpr = 2 if not big or (type_name == "Q4_K" and rpw == 4) else 1
    return kernel, rpw, wpr


def matvec_q8t(w_raw, type_name, xq, xm, y, wpr: int | None = None, rpw: int | None = None,
               kernel: str | None = None) -> None:
    """y = x W^T for 2..MATVEC_MAX_TOKENS tokens of activations quantize_q8_1 made: w_raw cupy uint8 (n_out,
    row_bytes) of a Q8_MATVEC type, xq cupy int8 (n_tok, n_in), xm cupy float32 (n_tok, n_in / 32, 4), y cupy float32
    (n_tok, n_out). kernel: one of Q8T_KERNELS ("mma" for Q8T_MMA_TYPES only); rpw rows a warp (2 or 4; dp4a only);
    wpr warps a row group (1, 2, 4 or 8). None: q8t_config's."""
    if type_name not in Q8_MATVEC:
        raise ValueError(f"no q8 matvec for {type_name}; it has: {', '.join(Q8_MATVEC)}")
    k, n_out, n_in = _check_weight("w_raw", w_raw, type_name)
    n_tok = _check_q8_act(xq, xm, n_in, 2, MATVEC_MAX_TOKENS)
    _check("y", y, np.float32, (2,))
    if y.shape != (n_tok, n_out):
        raise ValueError(f"q8 matvec of {n_tok} tokens x {n_out}x{n_in}: y has shape {y.shape}")
    kernel, rpw, wpr = q8t_config(type_name, n_out, n_tok, kernel, rpw, wpr)
    if kernel not in Q8T_KERNELS or (kernel == "mma" and type_name not in Q8T_MMA_TYPES):
        raise ValueError(f"matvec_q8t kernel {kernel!r} does not exist for {type_name}")
    if wpr not in (1, 2, 4, 8) or rpw not in (2, 4):
        raise ValueError(f"matvec_q8t takes 2 or 4 rows a warp and 1, 2, 4 or 8 warps a row, found {rpw}, {wpr}")
    if kernel == "mma":
        _mmq_launch(w_raw, k, _q8_mma_pack(xq, xm), y, n_out, n_in, n_tok, wpr, q8t_rt(type_name, n_out))
        return
    i32 = np.int32
    nt = 2 if n_tok == 2 else 4 if n_tok <= 4 else 8
    grid = -(-(-(-n_out // rpw)) // (MV_WARPS // wpr))
    fn = get_kernel("matvec_q8", f"matvec_q8t_{k.suffix}_{nt}_r{rpw}")
    fn((grid,), (256,), (w_raw, xq, xm, y, i32(n_out), i32(n_in // k.block_size), i32(n_tok), i32(wpr)))


Q6K_Q8T_RT2_MAX_ROWS = 16384  # a Q6_K matrix of up to this many rows takes 2 row tiles a warp in matvec_q8t's
# tensor-core kernel (each activation fragment serves both): at 2, 4 and 8 tokens 33.2 against 45-48 us on 4096x14336
# and 10.5 against 12.1 on 1024x4096, while 128256x4096 keeps 1 (227-232 against 227-239); Q4_K keeps 1 (H200,
# scripts/gpu_mmq_check.py --tokens 2,4,8)


def q8t_rt(type_name: str, n_out: int) -> int:
    """Row tiles of 16 a warp of matvec_q8t's tensor-core kernel (2-8 tokens)."""
    return 2 if type_name == "Q6_K" and n_out <= Q6K_Q8T_RT2_MAX_ROWS else 1


MMQ_GROUPS = (1, 2, 4, 8)  # column groups of 8 tokens with a compiled tensor-core kernel (matvec_mmq_<type>[_g<G>])


def mmq_groups(n_tok: int) -> int:
    """Column groups of 8 tokens the tensor-core kernel takes for n_tok tokens (the smallest compiled one)."""
    for g in MMQ_GROUPS:
        if n_tok <= 8 * g:
            return g
    raise ValueError(f"the tensor-core kernel takes up to {8 * MMQ_GROUPS[-1]} tokens, found {n_tok}")


MMQ_WPR = 8  # warps a 16-row tile of the tensor-core kernel, as the sweeps of scripts/gpu_q8t_check.py (2-8 tokens)
# and scripts/gpu_mmq_check.py (16-64) chose
MMQ_RT_FROM = 33  # from here on a matrix of 4096 rows or more takes 2 row tiles a warp (each activation fragment
# serves both): at 64 tokens 0.7x the time of one tile on Q6_K 4096x14336 and 128256x4096, 0.9x on Q4_K; at 32 and
# 16 even or worse (H200, scripts/gpu_mmq_check.py)


def mmq_rt(n_out: int, n_tok: int) -> int:
    """Row tiles of 16 a warp the tensor-core kernel takes by default for n_tok tokens of an n_out-row matrix."""
    return 2 if n_tok >= MMQ_RT_FROM and n_out >= 4096 else 1


def matmul_mmq(w_raw, type_name, xq, xm, y, wpr: int | None = None, packed: tuple | None = None,
               rt: int | None = None) -> None:
    """y = x W^T for 1..8 x MMQ_GROUPS[-1] tokens of activations quantize_q8_1 made, on the tensor cores (matvec_mmq.cu:
    a warp's 16 rows of a sub-block unpacked once for every group of 8 tokens): w_raw cupy uint8 (n_out, row_bytes) of
    a Q8T_MMA_TYPES type, xq cupy int8 (n_tok, n_in), xm cupy float32 (n_tok, n_in / 32, 4), y cupy float32 (n_tok,
    n_out). wpr: warps a row tile (1, 2, 4 or 8; None: MMQ_WPR). rt: row tiles of 16 a warp (1 or 2; None:
    mmq_rt's). packed: the activations already in the kernel's layout (_q8_mma_pack(xq, xm, mmq_groups(n_tok))),
    for callers that multiply one x by several weights."""
    if type_name not in Q8T_MMA_TYPES:
        raise ValueError(f"no tensor-core kernel for {type_name}; it has: {', '.join(Q8T_MMA_TYPES)}")
    k, n_out, n_in = _check_weight("w_raw", w_raw, type_name)
    n_tok = _check_q8_act(xq, xm, n_in, 0, 8 * MMQ_GROUPS[-1])
    _check("y", y, np.float32, (2,))
    if y.shape != (n_tok, n_out):
        raise ValueError(f"tensor-core matmul of {n_tok} tokens x {n_out}x{n_in}: y has shape {y.shape}")
    wpr = MMQ_WPR if wpr is None else wpr
    if wpr not in (1, 2, 4, 8):
        raise ValueError(f"the tensor-core kernel takes 1, 2, 4 or 8 warps a row tile, found {wpr}")
    rt = mmq_rt(n_out, n_tok) if rt is None else rt
    if rt not in (1, 2):
        raise ValueError(f"the tensor-core kernel takes 1 or 2 row tiles a warp, found {rt}")
    if n_tok == 0 or n_out == 0:
        return
    groups = mmq_groups(n_tok)
    _mmq_launch(w_raw, k, _q8_mma_pack(xq, xm, groups) if packed is None else packed, y, n_out, n_in, n_tok, wpr, rt)


def _mmq_launch(w_raw, k: GpuKernel, packed: tuple, y, n_out: int, n_in: int, n_tok: int, wpr: int,
                rt: int = 1) -> None:
    groups = mmq_groups(n_tok)
    grid = -(-(-(-n_out // (16 * rt))) // (MV_WARPS // wpr))
    fn = get_kernel("matvec_q8", f"matvec_mmq_{k.suffix}" + ("" if groups == 1 else f"_g{groups}")
                    + ("" if rt == 1 else f"_t{rt}"))
    # dynamic shared memory: the row tile's sums where wpr > 1 (mmq_store), Q6_K's staged blocks (matvec_mmq_q6k.cu)
    smem = MV_WARPS * 4 * groups * rt * 32 * 4 if wpr > 1 else 0
    if k.name == "Q6_K":
        smem = max(smem, MV_WARPS * MMQ6_STAGES * 16 * rt * MMQ6_SLOT)
    if fn.max_dynamic_shared_size_bytes < smem:  # past 48 KiB needs the opt-in attribute
        fn.max_dynamic_shared_size_bytes = smem
    i32 = np.int32
    fn((grid,), (256,), (w_raw, *packed, y, i32(n_out), i32(n_in // k.block_size), i32(n_tok), i32(wpr)),
       shared_mem=smem)


def _q8_mma_pack(xq, xm, groups: int = 1) -> tuple:
    """quantize_q8_1's activations of up to 8 x groups tokens in matvec_mmq's layout for T = 8 x groups columns
    (q8_mma_pack): (pq int8 (n / 32, T, 32), pm float32 (n / 32, T, 2)), one buffer; tokens past n_tok
    uninitialized (never read into a stored sum)."""
    import cupy  # noqa: PLC0415

    n_tok, n = xq.shape
    t = 8 * groups
    pq, pm = _mma_buffers(n, t)
    fn = get_kernel("matvec_q8", "q8_mma_pack")
    words = n_tok * n // 4
    if words:
        fn(((words + 255) // 256,), (256,), (xq, xm, pq, pm, np.int32(n), np.int32(n_tok), np.int32(t)))
    return pq, pm


def _mma_buffers(n: int, t: int) -> tuple:
    """Uninitialized (pq, pm) of matvec_mmq's layout for T = t token columns of n values (one buffer)."""
    import cupy  # noqa: PLC0415

    nb = n // Q8_BLOCK
    buf = cupy.empty(nb * t * 32 + nb * t * 8, dtype=cupy.uint8)
    return buf[:nb * t * 32].view(cupy.int8), buf[nb * t * 32:].view(cupy.float32)


def quantize_q8_mma(x, groups: int = 1) -> tuple:
    """x cupy float32 (n_tok, n), n_tok <= 8 x groups, n % 32 == 0 -> the tensor-core kernels' activations (pq, pm)
    in one launch: the bytes _q8_mma_pack(*quantize_q8_1(x), groups) gives, for an x that only tensor-core products
    read (quantize_q8_1's own layout is not written)."""
    _check("x", x, np.float32, (2,))
    n_tok, n = x.shape
    if n % Q8_BLOCK:
        raise ValueError(f"x rows of {n} values are not whole blocks of {Q8_BLOCK}")
    t = 8 * groups
    if n_tok > t:
        raise ValueError(f"{n_tok} tokens do not fit {groups} column groups of 8")
    pq, pm = _mma_buffers(n, t)
    total = n_tok * n
    if total:
        get_kernel("matvec_q8", "quantize_q8_mma")(((total + 255) // 256,), (256,), (
            x, pq, pm, np.int32(n), np.int32(n_tok), np.int32(t)))
    return pq, pm


def _mma_route(type_name: str, n_out: int, n_tok: int, q8: bool | None, wpr: int | None) -> int | None:
    """The warps a row tile when a product of 2..MATVEC_MAX_TOKENS tokens takes matvec_q8t's tensor-core kernel
    with its defaults (wpr None), else None."""
    if wpr is not None or not uses_q8t(type_name, n_tok, q8):
        return None
    kernel, _, w = q8t_config(type_name, n_out, n_tok)
    return w if kernel == "mma" else None


MMQ_MULTI = True  # matmul_many of 2-8 tokens: its Q4_K weights in one tensor-core launch (matvec_mmq_q4_k_m) where
# one of them takes the tensor cores; False: a launch each (q on the tensor cores, k and v on dp4a)
MMQ_MULTI_TYPE = "Q4_K"


def _mmq_multi(type_names, q8t: list[int], mma: dict) -> list[int]:
    """The weights of a 2-8 token matmul_many that share one launch of matvec_mmq_q4_k_m: every Q4_K weight on the
    8-bit path, when one of them takes the tensor cores with the default 16-row tiles, 8 warps a tile (the smaller
    ones, which alone would take dp4a, ride along) and there are two or more."""
    multi = [i for i in q8t if type_names[i] == MMQ_MULTI_TYPE]
    lead = [i for i in multi if mma.get(i) == MMQ_WPR]
    return multi if lead and len(multi) >= 2 else []


def _mmq_multi_launch(ws, packed: tuple, ys, n_in: int, n_tok: int) -> None:
    """ys[i] = x W_i^T for 1..Q8_MANY Q4_K weights of one n_in on the packed activations of n_tok (2-8) tokens, one
    launch (16-row tiles, MMQ_WPR warps a tile): each matrix's rows get the sums matvec_mmq_q4_k gives it alone."""
    k = GPU_KERNELS[MMQ_MULTI_TYPE]
    n_blocks = n_in // k.block_size
    n_outs = [int(w.shape[0]) for w in ws]
    ctas = [-(-(-(-n // 16)) // (MV_WARPS // MMQ_WPR)) for n in n_outs]
    pad = Q8_MANY - len(ws)  # unused slots repeat matrix 0 and get no CTA
    ws, ys, n_outs, ctas = list(ws) + [ws[0]] * pad, list(ys) + [ys[0]] * pad, n_outs + [0] * pad, ctas + [0] * pad
    c1, c2 = ctas[0], ctas[0] + ctas[1]
    smem = MV_WARPS * 4 * 32 * 4  # the row tiles' sums (mmq_store)
    i32 = np.int32
    get_kernel("matvec_q8", "matvec_mmq_q4_k_m")((c2 + ctas[2],), (256,), (
        *ws, *ys, *map(i32, n_outs), i32(c1), i32(c2), *packed, i32(n_blocks), i32(n_tok), i32(MMQ_WPR)),
        shared_mem=smem)


def _q8_launch(ws, type_name: str, xq, xm, ys, wpr, rpw, kernel: str | None) -> None:
    """ys[i] = W_i x for 1..Q8_MANY checked weights of type_name (one n_in) in one launch."""
    k = GPU_KERNELS[type_name]
    kernel = Q8_KERNEL[type_name] if kernel is None else kernel
    if kernel not in ("warp", "staged") or (kernel == "staged" and type_name not in Q8_STAGED):
        raise ValueError(f"q8 kernel {kernel!r} of {type_name}: 'warp' or, for {', '.join(Q8_STAGED)}, 'staged'")
    assert 1 <= len(ws) <= Q8_MANY == 3 and len(ys) == len(ws)
    n_blocks = ws[0].shape[1] // k.type_size
    n_outs = [int(w.shape[0]) for w in ws]
    if kernel == "staged":
        warps, rpws = Q6S_WARPS, (1, 2)
        rpw, auto_wpr = q8s_config(sum(n_outs), n_blocks, rpw)
    else:
        warps, rpws = MV_WARPS, (1, 2, 4)
        rpw, auto_wpr = q8_config(sum(n_outs), n_blocks * Q8_MATVEC[type_name], rpw)
    wpr = auto_wpr if wpr is None else wpr
    if rpw not in rpws:
        raise ValueError(f"rpw of the {kernel} q8 kernel must be one of {rpws}, found {rpw}")
    if wpr not in (1, 2, 4, 8) or wpr > warps:
        raise ValueError(f"wpr of the {kernel} q8 kernel must be a power of two up to {warps}, found {wpr}")
    per_cta = warps // wpr  # row groups per CTA
    ctas = [-(-(-(-n // rpw)) // per_cta) for n in n_outs]
    i32 = np.int32
    if kernel == "warp" and len(ws) == 1:  # the single-matrix entry, as before matmul_many
        fn = get_kernel("matvec_q8", f"matvec_q8_{k.suffix}_r{rpw}")
        fn((ctas[0],), (256,), (ws[0], xq, xm, ys[0], i32(n_outs[0]), i32(n_blocks), i32(wpr)))
        return
    pad = Q8_MANY - len(ws)  # unused slots repeat matrix 0 and get no CTA
    ws, ys, n_outs, ctas = list(ws) + [ws[0]] * pad, list(ys) + [ys[0]] * pad, n_outs + [0] * pad, ctas + [0] * pad
    c1, c2 = ctas[0], ctas[0] + ctas[1]
    grid = c2 + ctas[2]
    if grid == 0:
        return
    fn = get_kernel("matvec_q8", f"matvec_q8{'s' if kernel == 'staged' else 'm'}_{k.suffix}_r{rpw}")
    fn((grid,), (warps * 32,), (*ws, *ys, *map(i32, n_outs), i32(c1), i32(c2), xq, xm, i32(n_blocks), i32(wpr)))


def matmul_many(ws_raw, type_names, x, q8: bool | None = None, q8_act: tuple | None = None,
                stack: bool | None = None, wpr: int | None = None, rpw: int | None = None) -> tuple:
    """(x @ W_i.T for every weight) for weights that multiply one x (q/k/v, gate/up), with fewer launches.

    ws_raw: cupy uint8 (n_out_i, row_bytes_i) each; type_names: their GGML types; x: cupy float32 (n_tok, n_in)
    or (n_in,). Returns a tuple of new C-contiguous float32 (n_tok, n_out_i) (or (n_out_i,)), as matmul's.
    One token: the weights that take the q8 path (uses_q8 with q8) are grouped by type, and each group of up to
    Q8_MANY is one launch over all their rows on one quantize_q8_1 of x (or q8_act); wpr, rpw apply to those.
    n_tok >= GEMM_MIN_TOKENS: the weights that take the tensor cores (uses_mmq) share one quantize_q8_1 of x and its
    packing; for the others x goes to fp16 once; with `stack` (None: if their n_out x n_in sum is at most
    GEMM_STACK_ELEMENTS) the quantized weights are dequantized into one fp16 scratch, rows stacked, for one GEMM
    whose columns are then copied out per weight. 2..8 tokens: one quantize_q8_1 of x (or q8_act) for every
    8-bit weight, and one packing of it for those that take the tensor cores (quantize_q8_mma, one launch, when no
    other needs quantize_q8_1's layout); with MMQ_MULTI, where a Q4_K weight takes the tensor cores, every Q4_K
    weight shares one launch (_mmq_multi). Anything else: matmul per weight.
    """
    import cupy  # noqa: PLC0415

    if len(ws_raw) != len(type_names) or not ws_raw:
        raise ValueError(f"matmul_many needs one type per weight and >= 1 weight: {len(ws_raw)} weights, "
                         f"{len(type_names)} types")
    _check("x", x, np.float32, (1, 2))
    checked = [_check_weight(f"ws_raw[{i}]", w, t) for i, (w, t) in enumerate(zip(ws_raw, type_names))]
    ks, n_outs = [c[0] for c in checked], [c[1] for c in checked]
    for (_, _, n_in), t in zip(checked, type_names):
        if n_in != x.shape[-1]:
            raise ValueError(f"x has {x.shape[-1]} features but the {t} weight rows hold {n_in}")
    x2 = _rows_of(x, n_in, type_names[0])  # (n_tok, n_in)
    n_tok = x2.shape[0]
    ys: list = [None] * len(ws_raw)
    if n_tok >= GEMM_MIN_TOKENS:
        mm = [i for i, t in enumerate(type_names) if n_outs[i] and uses_mmq(t, n_tok)]
        if mm:  # x quantized and packed once for every tensor-core weight
            xq, xm = quantize_q8_1(x2) if q8_act is None else q8_act
            packed = _q8_mma_pack(xq, xm, mmq_groups(n_tok))
            for i in mm:
                ys[i] = cupy.empty((n_tok, n_outs[i]), dtype=cupy.float32)
                matmul_mmq(ws_raw[i], type_names[i], xq, xm, ys[i], packed=packed)
        rest = [i for i in range(len(ws_raw)) if ys[i] is None]
        if rest:
            part: list = [None] * len(rest)
            _gemm_many([ks[i] for i in rest], [ws_raw[i] for i in rest], x2, part, n_in, stack)
            for i, y in zip(rest, part):
                ys[i] = y
    elif n_tok == 1:
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(type_names):
            if n_outs[i] and uses_q8(t, 1, q8):
                groups.setdefault(t, []).append(i)
        if groups:
            if q8_act is None:
                q8_act = quantize_q8_1(x2)
            _check_q8_act(*q8_act, n_in)
        for t, idx in groups.items():
            for s in range(0, len(idx), Q8_MANY):
                part = idx[s:s + Q8_MANY]
                for i in part:
                    ys[i] = cupy.empty((1, n_outs[i]), dtype=cupy.float32)
                _q8_launch([ws_raw[i] for i in part], t, *q8_act, [ys[i] for i in part], wpr, rpw, None)
    else:
        q8t = [i for i, t in enumerate(type_names) if n_outs[i] and uses_q8t(t, n_tok, q8)]
        mma = {i: w for i in q8t if (w := _mma_route(type_names[i], n_outs[i], n_tok, q8, None))}
        multi = _mmq_multi(type_names, q8t, mma) if MMQ_MULTI and wpr is None else []
        for i in multi:  # k and v ride in the launch of the q beside them
            mma[i] = MMQ_WPR
        if q8_act is None and len(q8t) > len(mma):
            q8_act = quantize_q8_1(x2)  # once for every weight of the 8-bit several-token matvec
        if mma:  # the tensor-core weights share one packing (made with the quantization when none needs xq, xm)
            packed = quantize_q8_mma(x2) if q8_act is None else _q8_mma_pack(*q8_act)
            for s in range(0, len(multi), Q8_MANY):
                part = multi[s:s + Q8_MANY]
                for i in part:
                    ys[i] = cupy.empty((n_tok, n_outs[i]), dtype=cupy.float32)
                _mmq_multi_launch([ws_raw[i] for i in part], packed, [ys[i] for i in part], n_in, n_tok)
            for i, w in mma.items():
                if ys[i] is not None:
                    continue
                ys[i] = cupy.empty((n_tok, n_outs[i]), dtype=cupy.float32)
                _mmq_launch(ws_raw[i], ks[i], packed, ys[i], n_outs[i], n_in, n_tok, w,
                            q8t_rt(type_names[i], n_outs[i]))
    for i, y in enumerate(ys):
        if y is None:
            ys[i] = matmul(ws_raw[i], type_names[i], x2, q8=q8, q8_act=q8_act)
    return tuple(y.reshape(n) if x.ndim == 1 else y for y, n in zip(ys, n_outs))


def dequantize(w_raw, type_name, rows=None, dtype=np.float32, out=None):
    """Dequantize rows of W on the GPU: rows (cupy int32 (n,)) or all -> (n, n_in) float32 (or float16)."""
    import cupy  # noqa: PLC0415

    k = gpu_kernel(type_name)
    _check("w_raw", w_raw, np.uint8, (2,))
    if w_raw.data.ptr % k.align:
        raise ValueError(f"w_raw of {type_name} must be {k.align}-byte aligned on the device")
    n_all, row_bytes = w_raw.shape
    n_in = row_bytes // k.type_size * k.block_size
    n = n_all if rows is None else int(rows.shape[0])
    dtype = np.dtype(dtype)
    if dtype == np.float16 and k.is_float:
        raise ValueError("fp16 dequantization is for quantized types (F16 rows are fp16 already)")
    if out is None:
        out = cupy.empty((n, n_in), dtype=dtype)
    if n == 0:
        return out
    rows_arg = np.uint64(0) if rows is None else cupy.ascontiguousarray(rows, dtype=cupy.int32)
    if k.is_float:
        fn = get_kernel(k.module, f"dequant_f32_{k.suffix}")
        total = n * n_in
        fn(((total + 255) // 256,), (256,), (w_raw, rows_arg, out, np.int32(n), np.int32(n_in)))
    else:
        fn = get_kernel(k.module, f"dequant_{'f16' if dtype == np.float16 else 'f32'}_{k.suffix}")
        n_blocks = n_in // k.block_size
        total = n * n_blocks * k.parts
        fn(((total + 255) // 256,), (256,), (w_raw, rows_arg, out, np.int32(n), np.int32(n_blocks)))
    return out


def _gemm_ex(a, a_type: int, b, b_type: int, c, m: int, n: int, kk: int, ldc: int) -> None:
    """Column-major C (m x n, ldc) = A^T (A: kk x m, lda kk) . B (kk x n, ldb kk), fp32 accumulate, fp32 C.

    With row-major W (m, kk), X (n, kk), Y (n, ldc): Y[:, :m] = X @ W.T.
    """
    import cupy  # noqa: PLC0415
    from cupy_backends.cuda.libs import cublas  # noqa: PLC0415

    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    try:
        cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, kk,
                      one.ctypes.data, a.data.ptr, a_type, kk, b.data.ptr, b_type, kk,
                      zero.ctypes.data, c, cupy.cuda.runtime.CUDA_R_32F, ldc,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)


def _gemm(k: GpuKernel, w_raw, x, y, n_in: int, x16=None) -> None:
    """y = x @ W.T by cuBLAS; x16: x as fp16 already (matmul_many shares it between weights), or None."""
    import cupy  # noqa: PLC0415

    r16, r32 = cupy.cuda.runtime.CUDA_R_16F, cupy.cuda.runtime.CUDA_R_32F
    n_out = w_raw.shape[0]
    n_tok = x.shape[0]
    if k.name == "F32":
        _gemm_ex(w_raw, r32, x, r32, y.data.ptr, n_out, n_tok, n_in, n_out)
        return
    if x16 is None and k.name != "BF16":
        x16 = x.astype(cupy.float16)
    if k.name == "F16":
        _gemm_ex(w_raw, r16, x16, r16, y.data.ptr, n_out, n_tok, n_in, n_out)
        return
    rows = _chunk_rows(n_in)
    for r0 in range(0, n_out, rows):
        r1 = min(n_out, r0 + rows)
        if k.name == "BF16":
            wc = dequantize(w_raw[r0:r1], k.name, dtype=np.float32)
            _gemm_ex(wc, r32, x, r32, y.data.ptr + 4 * r0, r1 - r0, n_tok, n_in, n_out)
        else:
            wc = dequantize(w_raw[r0:r1], k.name, dtype=np.float16)
            _gemm_ex(wc, r16, x16, r16, y.data.ptr + 4 * r0, r1 - r0, n_tok, n_in, n_out)


def _chunk_rows(n_in: int) -> int:
    """Rows of n_in values one dequantized fp16 chunk holds (GEMM_CHUNK_ELEMENTS, whole 128s, at least 128)."""
    return max(128, GEMM_CHUNK_ELEMENTS // n_in // 128 * 128)


def _gemm_many(ks: list, ws, x, ys: list, n_in: int, stack: bool | None) -> None:
    """ys[i] = x @ W_i.T (prefill) with x converted to fp16 once: the quantized weights stacked into one GEMM
    (stack; None: while their n_out x n_in sum is at most GEMM_STACK_ELEMENTS), the others one GEMM each."""
    import cupy  # noqa: PLC0415

    quant = [i for i, k in enumerate(ks) if not k.is_float]
    if stack is None:
        stack = sum(int(ws[i].shape[0]) for i in quant) * n_in <= GEMM_STACK_ELEMENTS
    if stack and len(quant) >= 2:
        for i, y in zip(quant, _gemm_stacked([ks[i] for i in quant], [ws[i] for i in quant], x, n_in)):
            ys[i] = y
    x16 = None
    for i, k in enumerate(ks):
        if ys[i] is not None:
            continue
        if x16 is None and k.name not in ("F32", "BF16"):
            x16 = x.astype(cupy.float16)  # (n_tok, n_in), made before the first output as matmul's is after it
        ys[i] = cupy.empty((x.shape[0], ws[i].shape[0]), dtype=cupy.float32)
        if ws[i].shape[0]:  # cuBLAS refuses ldc = 0
            _gemm(k, ws[i], x, ys[i], n_in, x16)


def _gemm_stacked(ks: list, ws: list, x, n_in: int) -> list:
    """[x @ W_i.T] of quantized weights sharing n_in as one GEMM: their rows dequantized into one fp16 scratch
    (chunks of _chunk_rows(n_in) rows, the scratch reused), one (n_tok, sum n_out) float32 product, whose
    columns are copied out per weight. Live at the peak: x16 + product + scratch, then product + outputs."""
    import cupy  # noqa: PLC0415

    r16 = cupy.cuda.runtime.CUDA_R_16F
    n_tok = x.shape[0]
    starts = np.cumsum([0] + [int(w.shape[0]) for w in ws]).tolist()
    n_total = starts[-1]
    rows = _chunk_rows(n_in)
    x16 = x.astype(cupy.float16)  # (n_tok, n_in)
    y_all = cupy.empty((n_tok, n_total), dtype=cupy.float32)  # (n_tok, sum n_out)
    # one scratch for every chunk: stream order has the GEMM read it before the next dequantize writes it
    scratch = cupy.empty((min(rows, n_total), n_in), dtype=cupy.float16)
    for r0 in range(0, n_total, rows):
        r1 = min(n_total, r0 + rows)
        for k, w, s, e in zip(ks, ws, starts, starts[1:]):
            a, b = max(r0, s), min(r1, e)
            if a < b:
                dequantize(w[a - s:b - s], k.name, dtype=np.float16, out=scratch[a - r0:b - r0])
        _gemm_ex(scratch, r16, x16, r16, y_all.data.ptr + 4 * r0, r1 - r0, n_tok, n_in, n_total)
    del scratch, x16  # back to the pool before the copies are made
    return [cupy.ascontiguousarray(y_all[:, s:e]) for s, e in zip(starts, starts[1:])]
