"""matmul_many (several weights times one x in fewer launches) and the staged Q6_K q8 kernels vs float64 references.

Every test needs a CUDA device through CuPy (marked `gpu`, skipped elsewhere by conftest.py).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import kernels_gpu.matmul as km  # noqa: E402
from kernels_gpu.matmul import matmul, matmul_many, matmul_mmq, matvec_q8, matvec_q8t, quantize_q8_1  # noqa: E402
from test_kernels_gpu import (NMSE_GEMM_F16, NMSE_GEMM_F32, NMSE_MATVEC, NMSE_MATVEC_Q8, nmse,  # noqa: E402
                              random_weight, ref_matmul, ref_matmul_q8)

pytestmark = pytest.mark.gpu

# (types, n_outs, n_in): q/k/v-like and gate/up-like sets, odd rows, a mixed set (v in Q6_K), more than
# Q8_MANY weights of one type, a float weight among quantized ones, a zero-row weight
SETS = [
    (("Q4_K", "Q4_K", "Q4_K"), (300, 37, 45), 768),
    (("Q4_K", "Q4_K", "Q6_K"), (256, 64, 64), 1280),
    (("Q6_K", "Q6_K", "Q6_K"), (1001, 33, 7), 1280),
    (("Q4_K", "Q4_K"), (4099, 4099), 512),
    (("Q6_K", "Q6_K"), (130, 131), 2048),
    (("Q4_K",) * 5, (40, 41, 1, 17, 96), 512),
    (("Q4_K", "F16", "Q6_K", "Q8_0"), (64, 40, 45, 33), 512),
    (("Q4_K", "Q4_K"), (64, 0), 256),
]


def _case(types, n_outs, n_in, n_tok, seed: str):
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    raws = [random_weight(t, n, n_in, rng) if n else np.zeros((0, n_in // 256 * 144), np.uint8)
            for t, n in zip(types, n_outs)]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    return raws, x


@pytest.mark.parametrize("case", range(len(SETS)))
def test_matmul_many_one_token(case, monkeypatch):
    monkeypatch.setattr(km, "Q8_AUTO", frozenset({"Q4_K", "Q6_K"}))  # both q8 kernels, whatever the default
    types, n_outs, n_in = SETS[case]
    raws, x = _case(types, n_outs, n_in, 1, f"many1{case}")
    ys = matmul_many([cupy.asarray(r) for r in raws], list(types), cupy.asarray(x))
    for y, raw, t, n in zip(ys, raws, types, n_outs):
        y = y.get()
        assert y.shape == (1, n) and np.isfinite(y).all(), (t, n)
        if not n:
            continue
        q8 = t in km.Q8_MATVEC
        ref = ref_matmul_q8(raw, t, x) if q8 else ref_matmul(raw, t, x)
        assert nmse(y, ref) < NMSE_MATVEC, (t, n)
        if q8 and n >= 37:
            assert nmse(y, ref_matmul(raw, t, x)) < NMSE_MATVEC_Q8, (t, n)
        alone = matmul(cupy.asarray(raw), t, cupy.asarray(x)).get()
        assert nmse(y, alone) < NMSE_MATVEC, (t, n)
        if n > 2:
            assert not y[:, 0].any()  # the all-zero row
    y1 = matmul_many([cupy.asarray(raws[0])], [types[0]], cupy.asarray(x[0]))  # 1-D x
    assert y1[0].shape == (n_outs[0],)


@pytest.mark.parametrize("kernel", ["warp", "staged"])
@pytest.mark.parametrize("rpw", [1, 2, 4])
@pytest.mark.parametrize("wpr", [1, 2, 4, 8])
def test_fused_q8_launch_configs(kernel, rpw, wpr):
    name = "Q6_K" if kernel == "staged" else "Q4_K"
    if kernel == "staged" and (rpw > 2 or wpr > km.Q6S_WARPS):
        pytest.skip("the staged kernel has 1 or 2 rows a warp and Q6S_WARPS warps a CTA")
    raws, x = _case((name,) * 3, (45, 7, 130), 3840, 1, f"cfg{kernel}{rpw}{wpr}")  # 15 blocks: chunks of 8, 7
    ys = matmul_many([cupy.asarray(r) for r in raws], [name] * 3, cupy.asarray(x), q8=True, wpr=wpr, rpw=rpw)
    for y, raw in zip(ys, raws):
        assert nmse(y.get(), ref_matmul_q8(raw, name, x)) < NMSE_MATVEC


@pytest.mark.parametrize("n_out, n_in", [(1, 256), (37, 768), (300, 1280), (1001, 1280), (4099, 512),
                                         (333, 4096), (64, 14336), (5, 2048)])
def test_q6k_staged_matvec(n_out, n_in):
    rng = np.random.default_rng(n_out * 7 + n_in)
    raw = random_weight("Q6_K", n_out, n_in, rng)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    xq, xm = quantize_q8_1(cupy.asarray(x))
    ref_q8 = ref_matmul_q8(raw, "Q6_K", x)
    for kernel in ("staged", "warp"):
        for w in (cupy.asarray(raw), cupy.asarray(np.concatenate([raw, raw]))[n_out:]):  # 2nd: a view, offset base
            y = cupy.full((1, n_out), np.nan, dtype=cupy.float32)
            matvec_q8(w, "Q6_K", xq, xm, y, kernel=kernel)
            y = y.get()
            assert np.isfinite(y).all() and nmse(y, ref_q8) < NMSE_MATVEC, (kernel, n_out, n_in)
            if n_out >= 37:
                assert nmse(y, ref_matmul(raw, "Q6_K", x)) < NMSE_MATVEC_Q8
            if n_out > 2:
                assert not y[:, 0].any()


def test_q6k_staged_unaligned_base():
    # a weight whose base is 2 (mod 16): every chunk is staged from the aligned span around it
    rng = np.random.default_rng(5)
    raw = random_weight("Q6_K", 50, 2048, rng)
    buf = cupy.zeros(raw.nbytes + 64, dtype=cupy.uint8)
    for shift in (2, 6, 14):
        w = buf[shift:shift + raw.nbytes].reshape(raw.shape)
        w[...] = cupy.asarray(raw)
        x = rng.standard_normal((1, 2048)).astype(np.float32)
        xq, xm = quantize_q8_1(cupy.asarray(x))
        y = cupy.empty((1, 50), dtype=cupy.float32)
        matvec_q8(w, "Q6_K", xq, xm, y, kernel="staged")
        assert nmse(y.get(), ref_matmul_q8(raw, "Q6_K", x)) < NMSE_MATVEC, shift
        for n_tok in (4, 20):  # the tensor-core kernel stages each block from the aligned pieces around it
            x = rng.standard_normal((n_tok, 2048)).astype(np.float32)
            xq, xm = quantize_q8_1(cupy.asarray(x))
            y = cupy.full((n_tok, 50), np.nan, dtype=cupy.float32)
            if n_tok <= 8:
                matvec_q8t(w, "Q6_K", xq, xm, y, kernel="mma")
            else:
                matmul_mmq(w, "Q6_K", xq, xm, y)
            assert nmse(y.get(), ref_matmul_q8(raw, "Q6_K", x)) < NMSE_MATVEC, (shift, n_tok)


@pytest.mark.parametrize("case", range(len(SETS)))
@pytest.mark.parametrize("stack", [None, True, False])
def test_matmul_many_prefill(case, stack):
    types, n_outs, n_in = SETS[case]
    raws, x = _case(types, n_outs, n_in, 16, f"many16{case}")
    ys = matmul_many([cupy.asarray(r) for r in raws], list(types), cupy.asarray(x), stack=stack)
    for y, raw, t, n in zip(ys, raws, types, n_outs):
        y = y.get()
        assert y.shape == (16, n) and np.isfinite(y).all() and y.flags.c_contiguous
        if n:
            # 16 rows of a tensor-core type: 8-bit activations (km.uses_mmq), as one to eight rows take
            tol = (NMSE_GEMM_F32 if t in ("F32", "BF16") else NMSE_MATVEC_Q8 if km.uses_mmq(t, 16)
                   else NMSE_GEMM_F16)
            assert nmse(y, ref_matmul(raw, t, x)) < tol, (t, n)
            # the same fp16 inputs as matmul's own GEMM: only cuBLAS's summation order may differ
            assert nmse(y, matmul(cupy.asarray(raw), t, cupy.asarray(x)).get()) < 1e-10, (t, n)


def test_matmul_many_prefill_stacked_in_chunks(monkeypatch):
    # chunks of 256 rows over a stack of 300 + 37 + 300 rows: chunks that hold parts of two and three weights
    monkeypatch.setattr(km, "GEMM_CHUNK_ELEMENTS", 256 * 1024)
    types, n_outs = ("Q4_K", "Q6_K", "Q4_K"), (300, 37, 300)
    raws, x = _case(types, n_outs, 1024, 40, "chunks")
    ys = matmul_many([cupy.asarray(r) for r in raws], list(types), cupy.asarray(x), stack=True)
    for y, raw, t in zip(ys, raws, types):
        assert nmse(y.get(), ref_matmul(raw, t, x)) < (NMSE_MATVEC_Q8 if km.uses_mmq(t, 40) else NMSE_GEMM_F16)


def test_matmul_many_in_a_cuda_graph(monkeypatch):
    # the decode path must capture: no host syncs or copies; a replay on new x gives the new result
    monkeypatch.setattr(km, "Q8_AUTO", frozenset({"Q4_K", "Q6_K"}))
    types, n_outs, n_in = SETS[1]
    raws, x = _case(types, n_outs, n_in, 1, "graph")
    ws = [cupy.asarray(r) for r in raws]
    xd = cupy.asarray(x)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        matmul_many(ws, list(types), xd)  # warm-up: compile, fill the pool
        s.synchronize()
        s.begin_capture()
        ys = matmul_many(ws, list(types), xd)
        g = s.end_capture()
        x2 = np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)
        xd[...] = cupy.asarray(x2)
        g.launch(stream=s)
        s.synchronize()
    for y, raw, t in zip(ys, raws, types):
        assert nmse(y.get(), ref_matmul_q8(raw, t, x2)) < NMSE_MATVEC


def test_backend_matmuls_vs_matmul():
    from hybrid.backends.gpu import GpuBackend
    from hybrid.model.weights import Weight

    gpu = GpuBackend()
    rng = np.random.default_rng(31)
    ws = [gpu.upload(Weight(f"w{i}", t, (n, 512), random_weight(t, n, 512, rng)))
          for i, (t, n) in enumerate((("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)))]
    for n_tok in (1, 3, 16):
        x = gpu.from_host(rng.standard_normal((n_tok, 512)).astype(np.float32))
        ys = gpu.matmuls(ws, x)
        for w, y in zip(ws, ys):
            ref = gpu.matmul(w, x)
            assert y.shape == ref.shape
            assert nmse(y.get(), ref.get()) < (NMSE_MATVEC if n_tok < km.GEMM_MIN_TOKENS else NMSE_GEMM_F16)
