"""Plain kernels kept out of the packages: the pre-SIMD CPU matmul on raw blocks (quant_dot_legacy, quant_dot_k).

`scripts/bench_matmul.py --baseline` times them next to kernels_cpu.matmul; tests/test_kernels_cpu_matmul.py checks
them against float64 `dequantize(w) @ x`. Both import this package as `reference` (tests/ on sys.path): Numba's
on-disk cache records module names, so one name only.
"""

from pathlib import Path

import numpy as np

from kernels_cpu import act_quant, drop_stale_cache

drop_stale_cache(Path(__file__).parent)  # quant_dot_k's kernels compile quant_dot_legacy's in: as kernels_cpu does

from . import quant_dot_k, quant_dot_legacy  # noqa: E402

# GGML type -> the kind code of one compiled kernel
LEGACY_KINDS = {"Q4_0": quant_dot_legacy.Q4_0, "Q4_1": quant_dot_legacy.Q4_1, "Q5_0": quant_dot_legacy.Q5_0,
                "Q5_1": quant_dot_legacy.Q5_1, "Q8_0": quant_dot_legacy.Q8_0, "IQ4_NL": quant_dot_legacy.IQ4_NL}
K_KINDS = {"Q2_K": quant_dot_k.Q2_K, "Q3_K": quant_dot_k.Q3_K, "Q4_K": quant_dot_k.Q4_K, "Q5_K": quant_dot_k.Q5_K,
           "Q6_K": quant_dot_k.Q6_K, "IQ4_XS": quant_dot_k.IQ4_XS}
BASELINE_TYPES = (*LEGACY_KINDS, *K_KINDS)


def matmul_baseline(w: np.ndarray, type_name: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y[t, r] = row r of w . x[t], the pre-SIMD way: w uint8 (n_out, row_bytes) raw blocks of `type_name` (one of
    BASELINE_TYPES), x float32 (n_tok, n_in) quantized to Q8_0 / Q8_K first, as ggml does; y float32 (n_tok, n_out)."""
    if type_name in LEGACY_KINDS:
        qs, d = act_quant.quantize_q8_0(x)
        quant_dot_legacy.matmul_legacy(w, LEGACY_KINDS[type_name], act_quant.dequantize_q8_0(qs, d), y, 16)
    elif type_name in K_KINDS:
        qs, d, bsums = act_quant.quantize_q8_k(x)
        quant_dot_k.matmul_k(w, K_KINDS[type_name], qs, d, bsums, y, 16)
    else:
        raise ValueError(f"the baseline kernels cover {', '.join(BASELINE_TYPES)}, found {type_name!r}")
    return y
