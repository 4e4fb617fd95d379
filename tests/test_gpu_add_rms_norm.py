"""kernels_gpu.ops.add_rms_norm (the residual add and the next norm in one kernel) vs float64 and vs rms_norm.

Needs a CUDA device through CuPy (marked `gpu`, skipped elsewhere by conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from kernels_gpu import ops  # noqa: E402

pytestmark = pytest.mark.gpu

NMSE_NORM = 1e-12  # as test_kernels_gpu: float32 sums of squares vs float64


def _nmse(a, ref):
    return float(((a - ref) ** 2).sum() / (ref**2).sum())


# 2880: no float4 CTA shape (rms_norm_f32); 1024 on: a CTA a row in registers (rms_norm_vec*)
@pytest.mark.parametrize("n_tok,n",
                         [(1, 4096), (1, 640), (7, 33), (3, 4096), (9, 1024), (1, 5120), (512, 2048), (1, 2880),
                          (2, 32768), (3, 16384)])
@pytest.mark.parametrize("with_w", [True, False])
def test_add_rms_norm_is_the_add_then_rms_norm(n_tok, n, with_w):
    rng = np.random.default_rng(n_tok * 1000 + n)
    x = (rng.standard_normal((n_tok, n)) * 3).astype(np.float32)
    a = rng.standard_normal((n_tok, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32) if with_w else None
    wd = None if w is None else cupy.asarray(w)
    total, y = ops.add_rms_norm(cupy.asarray(x), cupy.asarray(a), wd, 1e-6)
    np.testing.assert_array_equal(total.get(), x + a)  # float32 adds, as numpy's
    # the same threads and reduction order as rms_norm: equal to rms_norm of the sum, bit for bit
    np.testing.assert_array_equal(y.get(), ops.rms_norm(cupy.asarray(x + a), wd, 1e-6).get())
    s = x.astype(np.float64) + a
    ref = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6)
    if w is not None:
        ref = ref * w
    assert np.isfinite(y.get()).all() and _nmse(y.get(), ref) < NMSE_NORM


def test_add_rms_norm_checks_shapes():
    x = cupy.zeros((2, 64), dtype=cupy.float32)
    with pytest.raises(ValueError, match="differ in shape"):
        ops.add_rms_norm(x, cupy.zeros((2, 32), dtype=cupy.float32), None, 1e-6)


@pytest.mark.parametrize("n_tok,n", [(1, 4096), (1, 2048), (3, 1024), (1, 5120), (2, 32768), (1, 2880), (1, 640)])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_q8_is_the_norm_then_quantize_q8_1(n_tok, n, add):
    """rms_norm_q8 (the norm of a decode row and its 8-bit quantization in one kernel) gives rms_norm's / add_rms_norm's
    values and quantize_q8_1's bytes of them exactly; None where the row takes no one-CTA-a-row kernel."""
    from kernels_gpu.matmul import quantize_q8_1

    rng = np.random.default_rng(n)
    x = (rng.standard_normal((n_tok, n)) * 3).astype(np.float32)
    x[0, 64:96] = 0  # an all-zero block of the output (q = 0, d = 0)
    a = rng.standard_normal((n_tok, n)).astype(np.float32)
    a[0, 64:96] = 0
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    got = ops.rms_norm_q8(cupy.asarray(x), w, 1e-6, a=cupy.asarray(a) if add else None)
    if n < 1024 or n % 128:
        assert got is None
        return
    if add:
        total, out, (xq, xm) = got
        ref_total, ref = ops.add_rms_norm(cupy.asarray(x), cupy.asarray(a), w, 1e-6)
        np.testing.assert_array_equal(total.get(), ref_total.get())
    else:
        out, (xq, xm) = got
        ref = ops.rms_norm(cupy.asarray(x), w, 1e-6)
    np.testing.assert_array_equal(out.get(), ref.get())
    rq, rm = quantize_q8_1(ref)
    np.testing.assert_array_equal(xq.get(), rq.get())
    np.testing.assert_array_equal(xm.get(), rm.get())
