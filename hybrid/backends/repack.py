"""CPU weight repacking, as llama.cpp's CPU_REPACK buffers (`--no-repack` keeps the file's layout): the Q4_0,
Q5_0, Q4_K, MXFP4 and IQ4_XS matrices of the layers the CPU runs are copied once, at load, into 8-row interleaved
groups (kernels_cpu.legacy_x8, q4_k_x8, mxfp4_x8, iq4_xs_x8), which its integer dots read at a lower cost per byte.
The copy replaces the mapping's pages: each matrix's pages are released (MADV_DONTNEED) as soon as it is copied, so
the resident memory grows by at most the layout's extra bytes (Q4_K: 4 bytes a block, 2.8%; IQ4_XS: 2 bytes a
block, 1.5%; Q4_0/Q5_0/MXFP4: none), not by the matrices. Bytes a matrix shares with its neighbours' pages stay
mapped.

Matrices and MoE expert tensors (each expert's matrix on its own) are repacked; not an output tied to the token
embeddings (the embedding lookup reads its rows), and nothing when op offload streams the CPU layers' weights to
a GPU as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kernels_cpu import iq4_xs_x8, legacy_x8, mxfp4_x8, q4_k_x8
from kernels_cpu.signatures import REPACK as _COMPILED_REPACKS

from hybrid.system.memlock import release_pages
from hybrid.model.weights import ModelWeights, Weight

# GGML type -> (the repacked layout's name in kernels_cpu.matmul.REPACKED, can this shape be repacked, repack)
LAYOUTS = {
    "Q4_0": ("Q4_0_X8", legacy_x8.repackable, legacy_x8.repack_q4_0),
    "Q5_0": ("Q5_0_X8", legacy_x8.repackable, legacy_x8.repack_q5_0),
    "Q4_K": ("Q4_K_X8", q4_k_x8.repackable, q4_k_x8.repack),
    "MXFP4": ("MXFP4_X8", mxfp4_x8.repackable, mxfp4_x8.repack),
    "IQ4_XS": ("IQ4_XS_X8", iq4_xs_x8.repackable, iq4_xs_x8.repack),
}


@dataclass(frozen=True)
class RepackResult:
    n_matrices: int = 0
    n_bytes: int = 0  # bytes of the repacked copies
    released_bytes: int = 0  # bytes of the file's pages given back
    types: tuple[str, ...] = ()  # the GGML types repacked


def repack_weights(weights: ModelWeights, layers: Iterable[int], output: bool) -> RepackResult:
    """Repack, in place in `weights`, the matrices of the repeating layers `layers` and (output=True) the output
    matrix, where their type has a repacked layout. Returns what was done."""
    done: list[tuple[str, int, int]] = []  # (type, bytes copied, bytes released), one per matrix

    def repack(w: Weight) -> Weight:
        new = _repacked(w)
        if new is None:
            return w
        done.append((w.type_name, new.nbytes, release_pages(w.raw)))  # each one's pages as soon as it is copied
        return new

    for il in layers:
        lw = weights.layers[il]
        for key, w in list(lw.items()):
            lw[key] = repack(w)
    if output and weights.output is not weights.token_embd:
        weights.output = repack(weights.output)
    return RepackResult(len(done), sum(d[1] for d in done), sum(d[2] for d in done),
                        tuple(sorted({d[0] for d in done})))


def repacked_type(w: Weight) -> str | None:
    """The layout `repack_weights` gives w (a name in kernels_cpu.matmul.REPACKED), or None where it keeps w."""
    layout = LAYOUTS.get(w.type_name)
    # only the types whose repack kernel the ahead-of-time compile list names (backends/cpu_kernels.py looks it up
    # in kernels_cpu.signatures.REPACK for every matrix this function repacks)
    if (layout is None or w.type_name not in _COMPILED_REPACKS or not isinstance(w.raw, np.ndarray)
            or w.raw.ndim not in (2, 3)):
        return None
    name, repackable, _ = layout
    return name if repackable(w.shape[-2:]) else None


def _repacked(w: Weight) -> Weight | None:
    name = repacked_type(w)
    if name is None:
        return None
    repack = LAYOUTS[w.type_name][2]
    if w.raw.ndim == 2:
        return Weight(w.name, name, w.shape, repack(w.raw))
    first = repack(w.raw[0])  # MoE experts (n_expert, out, in): each expert's matrix on its own
    out = np.empty((w.raw.shape[0], *first.shape), dtype=np.uint8)
    out[0] = first
    for e in range(1, w.raw.shape[0]):
        out[e] = repack(w.raw[e])
    return Weight(w.name, name, w.shape, out)
