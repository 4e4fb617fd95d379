"""The matmul crossover per host (kernels_cpu.matmul.gemm_min_tokens): without VNNI every type switches to the
float GEMM at 64 tokens, as before; with VNNI the types of INT_DOTS_VNNI stay on the integer dots at every batch.
The choice follows kernels_cpu.simd_x8's VNNI decision, also for a target made AVX2-only by NUMBA_CPU_NAME and
NUMBA_CPU_FEATURES (a process of its own: Numba reads them when it starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels_cpu import gemm_f32, legacy_x8, simd_x8
from kernels_cpu import matmul as km
from test_kernels_cpu_matmul import random_weight

ALL = [*km.KERNELS, *km.REPACKED]
ROOT = Path(__file__).resolve().parents[1]


def test_without_vnni_every_type_switches_at_64(monkeypatch):
    monkeypatch.setattr(km, "_host_vnni", lambda: False)
    assert {t: km.gemm_min_tokens(t) for t in ALL} == dict.fromkeys(ALL, 64)
    assert km.SMALL_BATCH_TOKENS == 64  # the fused layers' decode-sized batches, on every host


def test_with_vnni_the_listed_types_never_take_the_gemm(monkeypatch):
    monkeypatch.setattr(km, "_host_vnni", lambda: True)
    assert km.INT_DOTS_VNNI < set(ALL)
    for t in ALL:
        assert km.gemm_min_tokens(t) == (km.NEVER if t in km.INT_DOTS_VNNI else 64), t


@pytest.mark.parametrize("vnni", [False, True])
def test_dispatch_follows_the_host(monkeypatch, vnni):
    """matmul and matmuls of 64 tokens: the GEMM where the host's crossover says so, else the integer dots."""
    monkeypatch.setattr(km, "_host_vnni", lambda: vnni)
    calls = []
    real = gemm_f32.gemm
    monkeypatch.setattr(gemm_f32, "gemm", lambda *a: calls.append(a[2]) or real(*a))
    rng = np.random.default_rng(5)
    w = legacy_x8.repack_q5_0(random_weight("Q5_0", 16, 64, rng))
    x = rng.standard_normal((64, 64)).astype(np.float32)
    y = km.matmul(w, "Q5_0_X8", x)
    (y2,) = km.matmuls([(w, "Q5_0_X8")], x)
    assert len(calls) == (0 if vnni else 2) and np.array_equal(y, y2)
    other = km.matmul(w, "Q5_0_X8", x, gemm_from=64 if vnni else km.NEVER)  # the other path: rounding apart
    assert np.allclose(y, other, rtol=1e-5, atol=1e-5 * np.abs(y).max())


def _run_dispatch(env: dict) -> dict:
    code = ("import json; from kernels_cpu import matmul as km, simd_x8; "
            "print(json.dumps({'vnni': simd_x8.host_vnni(), "
            "'x': {t: km.gemm_min_tokens(t) for t in [*km.KERNELS, *km.REPACKED]}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_avx2_target_keeps_64():
    """NUMBA_CPU_NAME=znver3 with the AVX-512 and VNNI features off (what the kernels compile for there): no VNNI, and
    every type's crossover is 64; this process's own target answers as simd_x8 decides."""
    from llvmlite import binding as ll

    feats = ll.get_host_cpu_features()
    off = [n for n in feats if n.startswith(("avx512", "avxvnni", "amx", "avx10"))]
    flat = ",".join(f"{'+' if on and n not in off else '-'}{n}" for n, on in feats.items())
    env = {**os.environ, "NUMBA_CPU_NAME": "znver3", "NUMBA_CPU_FEATURES": flat}
    got = _run_dispatch(env)
    assert got == {"vnni": False, "x": dict.fromkeys(ALL, 64)}
    here = _run_dispatch({k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")})
    assert here["vnni"] == simd_x8.vnni_in(set(n for n, on in feats.items() if on))
    assert here["x"] == {t: km.NEVER if here["vnni"] and t in km.INT_DOTS_VNNI else 64 for t in ALL}
