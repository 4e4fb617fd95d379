"""A MoE layer as the GPU's kernels take it (kernels_gpu.moe): its routing as a `Router`, with the router's bias and
the selection bias exp_probs_b on the device, and its experts' bias rows (gpt-oss), made once a layer and kept; None
where the device kernels cannot run the layer's MoE (a GLU or a routing they lack)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid.model.arch.moe import routing

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class DeviceMoe:
    router: object  # kernels_gpu.moe.Router
    biases: tuple  # gate's, up's and down's bias rows, float32 (n_expert, n_out) device views, or None each
    host_biases: bool  # some expert bias is in host memory (experts in RAM): biases holds None for it


class DeviceMoeLayers:
    """DeviceMoe of each MoE layer, made at its first use (an eager call: a decode step's first run is never
    captured) by `upload` (numpy -> device array) for the small routing vectors a layer may keep in RAM."""

    def __init__(self, upload) -> None:
        self._upload = upload
        self._layers: dict[int, tuple] = {}  # id of the router Weight -> (that Weight, DeviceMoe or None)

    def get(self, spec, cfg, lw) -> DeviceMoe | None:
        router = lw["ffn_gate_inp"]
        hit = self._layers.get(id(router))
        if hit is None or hit[0] is not router:
            hit = self._layers[id(router)] = (router, self._make(spec, cfg, lw))
        return hit[1]

    def _make(self, spec, cfg, lw) -> DeviceMoe | None:
        from kernels_gpu import moe  # noqa: PLC0415
        from kernels_gpu.ops import GLU_ACTS  # noqa: PLC0415

        if spec.ffn_act not in GLU_ACTS:
            return None
        r = routing(spec, cfg)
        dev = moe.Router(r.n_used, r.normalize, r.gating, r.scale, r.n_groups, r.n_group_used,
                         self._vector(lw, "ffn_gate_inp.bias"), self._vector(lw, "exp_probs_b.bias"),
                         self._upload(np.zeros(1, dtype=np.uint32)))  # the one-launch decode router's counter
        if dev.why_not(cfg.n_expert):
            return None
        rows = [bias_rows(lw, f"{n}.bias") for n in EXPERT_TENSORS]
        on_host = any(isinstance(b, np.ndarray) for b in rows)
        return DeviceMoe(dev, tuple(None if isinstance(b, np.ndarray) else b for b in rows), on_host)

    def _vector(self, lw, name: str):
        w = lw.get(name)
        if w is None:
            return None
        values = w.f32()
        if isinstance(values, np.ndarray):
            return self._upload(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
        return values.reshape(-1)


def bias_rows(lw, name: str):
    """A per-expert bias tensor as float32 rows (n_expert, n_out), a view of where it lives (numpy on the host, cupy
    on the device; a 2-D F32 tensor is held as raw bytes), or None where the layer has none."""
    w = lw.get(name)
    return None if w is None else w.f32()
