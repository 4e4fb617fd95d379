"""CpuBackend's whole MoE decode layers (kernels_cpu.moe.moe_layer_at): each layer's own arguments, the views of its
KV cache and its block table included (contiguous or a paged sequence), kept in one typed List, and a decode step's
shared ones (threads, RoPE tables, positions) made once a step, so that a layer's Python is a few lookups and one
call of 11 arguments. After the weights' streams have swept the caches every Python operation and every unboxed
argument costs a miss or several: the 44-argument call with the step's arguments gathered per layer took ~50 us a
layer (2-core Zen 4)."""

from __future__ import annotations

import numba
import numpy as np

from kernels_cpu import moe
from kernels_cpu.matmul import SMALL_BATCH_TOKENS

from hybrid.backends.cpu_fused import FusedLayers, fusable
from hybrid.backends.cpu_moe import FusedMoE


class _Direct:
    """A compiled kernel called straight through the entry point of its one compiled signature after the first
    call: numba's dispatcher types every argument on every call. Only for a kernel whose caller builds the same
    argument types every time (the entry point does not check them)."""

    def __init__(self, fn) -> None:
        self.fn, self.entry = fn, None

    def __call__(self, *args):
        if self.entry is not None:
            return self.entry(*args)
        out = self.fn(*args)
        if len(self.fn.signatures) == 1:
            self.entry = self.fn.overloads[self.fn.signatures[0]].entry_point
        return out


_MOE_LAYER_AT = _Direct(moe.moe_layer_at)  # one set of argument types (cpu_fused, cpu_moe)


class WholeLayers:
    """The one-call MoE layers of a CpuBackend: `__call__` runs layer il of a decode-sized batch, or returns None
    where the layer has no one-call form."""

    def __init__(self, fused: FusedLayers, moe_ffn: FusedMoE) -> None:
        self._fused, self._moe = fused, moe_ffn
        self._kv = None  # the cache whose views `_layers` holds
        self._layers = None  # typed List (kernels_cpu.moe.layer_list) of the layers' own arguments
        # il -> (lw, the cache's layer, index in _layers, step variant), index None: no one-call form
        self._slots: dict[int, tuple] = {}
        self._variants: dict[tuple, int] = {}  # (n_rot, base, scale, n_ctx) -> step variant
        self._key = None  # (positions bytes, threads) of the step whose arguments `_steps` holds
        self._steps: list = []  # per variant: (threads, cos, sin, n_rot, positions i32, i64, n_kv, heads per item)

    def __call__(self, spec, cfg, lw, il: int, x: np.ndarray, positions: np.ndarray, kv, tables) -> np.ndarray | None:
        """blocks.layer_forward of layer il, x (n_tok, n_embd) f32 at positions (n_tok,) into cache kv, bit for
        bit, or None; tables: the backend's RoPE tables (CpuBackend._tables)."""
        if not 0 < x.shape[0] < SMALL_BATCH_TOKENS:
            return None
        if kv is not self._kv:
            # a ragged batch: attention per sequence (a paged sequence alone reads through its table in the call)
            if hasattr(kv, "seqs"):
                return None
            self._kv, self._layers, self._slots, self._key = kv, None, {}, None
        # a new step: its arguments, the thread count among them (read once a step: numba.get_num_threads takes
        # ~10 us once the caches are cold; `hybrid bench -t 1,2` changes it between runs, each on a new cache)
        key = (positions.tobytes(), positions.dtype.num)
        if key != self._key:
            self._key, self._steps = key, [None] * len(self._steps)
        slot = self._slots.get(il)
        if slot is None or slot[0] is not lw or slot[1] is not kv.layers[il]:
            slot = self._slots[il] = self._slot(spec, cfg, lw, il, kv)
        if slot[2] is None:
            return None
        step = self._steps[slot[3]]
        if step is None:
            step = self._steps[slot[3]] = self._fused.step_args(spec, cfg, lw, il, positions, kv, tables)[:8]
        x = np.ascontiguousarray(x, dtype=np.float32)
        entry = _MOE_LAYER_AT.entry  # (the _Direct call's frame saved)
        if entry is None:
            return _MOE_LAYER_AT(step[0], x, *step[1:], self._layers, slot[2])
        return entry(step[0], x, *step[1:], self._layers, slot[2])

    def _slot(self, spec, cfg, lw, il: int, kv) -> tuple:
        """Layer il's entry: its own arguments appended to the List (None where it has no one-call form)."""
        layer = kv.layers[il]
        if not spec.moe or spec.sandwich_norm or not fusable(spec, lw, 1):
            return lw, layer, None, None
        tail = self._moe.half_args(spec, cfg, lw, 1)
        if tail is None:
            return lw, layer, None, None
        k_views, v_views, code_k, code_v, kv_layer, (kv_table, kv_bs) = self._fused._views(kv, il)
        n_ctx = kv_layer.n_ctx
        # (one eps: attention_half's, the layer's own, is the FFN half's too); a paged sequence's table is one array
        # its cache fills in place as it takes blocks, so the List's reference to it stays current
        own = ((k_views, v_views, code_k, code_v, kv_table, np.int64(kv_bs)) + self._fused.layer_args(spec, cfg, lw, il)
               + tail[1:])
        if self._layers is None:
            self._layers, index = moe.layer_list(own), 0
        else:
            index = moe.add_layer(self._layers, own)
        variant = self._variants.setdefault((*self._fused._layer(spec, cfg, lw, il).rope, n_ctx), len(self._variants))
        self._steps += [None] * (len(self._variants) - len(self._steps))
        return lw, layer, index, variant
