"""Which compiled kernels a model's CPU share calls (keys of kernels_cpu.signatures), so that a first run can
compile just those, ahead of the warm-up and in parallel (hybrid/engine/launch.py).

Read from the weights' types and the architecture, before the repack: layers of integer-dot types take the fused
form (cpu_fused), others go op by op, where only the matrix products and the common ops are listed (anything else,
MoE experts and float matrices among them, compiles on its first call as before)."""

from __future__ import annotations

from collections.abc import Iterable

from kernels_cpu import get_rows
from kernels_cpu import signatures as sig
from kernels_cpu.matmul import KERNELS

from hybrid.backends.cpu_fused import ffn_fusable, fusable
from hybrid.backends.repack import repacked_type, tied_repacks
from hybrid.model.arch.spec import ArchSpec
from hybrid.model.weights import Weight

_OP_BY_OP = (sig.RMS_NORM, "rope.rope_apply_rows", "kv_cache._store_kv", "attention._attention_kernel")
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output")
_FFN_MATRICES = ("ffn_gate", "ffn_up", "ffn_down")


def _products(ws: Iterable[Weight]) -> set[str]:
    """The integer-dot drivers of these matrices' types (float types: none listed)."""
    out: set[str] = set()
    for w in ws:
        kernel = KERNELS.get(w.type_name)
        if kernel is not None:
            out.update(sig.INT_DOTS.get(kernel.vec_dot_type, ()))
    return out


def cpu_kernel_keys(spec: ArchSpec, layers: Iterable[dict[str, Weight]], output: Weight | None, repack: bool,
                    output_tied: bool = False, embedding: Weight | None = None) -> tuple[str, ...]:
    """The kernels a warm-up calls for these CPU layers and, unless None, the output matrix `output` (on the CPU,
    with its norm), and the sampler's top-k; with repack, the repack's kernels for the types it will interleave (an
    output tied to the token embeddings only where the lookup reads the layout: repack.tied_repacks); the compiled
    embedding lookup where `embedding` (the token embeddings, always looked up on the CPU) has a type it decodes.
    Sorted keys of kernels_cpu.signatures.KERNELS."""
    keys: set[str] = {sig.TOP_K}  # the sampler's, whatever runs the layers
    if embedding is not None and embedding.type_name in get_rows.TYPES:
        keys.update(sig.GET_ROWS)
    matrices: list[Weight] = []
    for lw in layers:
        keys.add(sig.ROPE_TABLES)
        fused = not spec.mla and fusable(spec, lw, 1)  # MLA (deepseek2) runs its attention op by op
        if fused:
            keys.add(sig.FUSED_ATTENTION)
        else:
            keys.update(_OP_BY_OP)
            keys |= _products(w for n, w in lw.items() if n.startswith("attn_") and w.raw.ndim >= 2)
        if fused and ffn_fusable(spec, lw):
            keys.add(sig.FUSED_FFN)
        elif not spec.moe:
            keys.update((sig.RMS_NORM, "activations.glu_rows"))
            keys |= _products(lw[n] for n in _FFN_MATRICES)
        matrices += lw.values()
    if output is not None:
        keys.add(sig.RMS_NORM)
        keys |= _products([output])
        if not output_tied or tied_repacks(output):
            matrices.append(output)
    if repack:
        keys.update(sig.REPACK[w.type_name] for w in matrices if repacked_type(w) is not None)
    return tuple(sorted(keys))
