"""-ub auto (`hybrid serve`'s default): the whole -b where every layer is on the GPU and the plan with micro-batches
that large fits the VRAM with headroom, else 512 (hybrid/engine/launch.py resolve_ubatch). The GPU is a stand-in
(probe_gpus patched): only the decision is tested here, on the demo model's real tensors."""

from __future__ import annotations

import pytest

import hybrid.engine.launch as launch
from hybrid.engine.params import EngineParams
from hybrid.plan.probe import DEFAULT_MARGIN_BYTES
from hybrid.system.devices import GpuInfo
from hybrid.system.sizes import GiB, MiB


def _gpu(free: int):
    return lambda: ((GpuInfo(0, "stand-in", 24 * GiB, free, "8.6"),), "")


def _resolve(demo_model, monkeypatch, free: int, **kw) -> EngineParams:
    monkeypatch.setattr(launch, "probe_gpus", _gpu(free))
    said: list[str] = []
    out = launch.resolve_ubatch(demo_model, EngineParams(n_ubatch=None, **kw), said.append)
    assert bool(said) == (out.n_ubatch > 512), said  # the larger choice is said, the fallback is not
    return out


def test_a_given_ubatch_is_kept(demo_model, monkeypatch):
    monkeypatch.setattr(launch, "probe_gpus", _gpu(24 * GiB))
    p = EngineParams(n_ubatch=256, n_gpu_layers="all")
    assert launch.resolve_ubatch(demo_model, p, print) is p


def test_every_layer_on_a_roomy_gpu_takes_the_whole_batch(demo_model, monkeypatch):
    assert _resolve(demo_model, monkeypatch, 24 * GiB, n_gpu_layers="all").n_ubatch == 2048
    assert _resolve(demo_model, monkeypatch, 24 * GiB, n_gpu_layers="all", n_batch=1024).n_ubatch == 1024


@pytest.mark.parametrize("kw", [{"n_gpu_layers": 0}, {"n_gpu_layers": 5}, {"n_gpu_layers": "all", "n_batch": 256}])
def test_cpu_layers_or_a_small_batch_keep_512_or_less(demo_model, monkeypatch, kw):
    p = _resolve(demo_model, monkeypatch, 24 * GiB, **kw)
    assert p.n_ubatch == min(512, p.n_batch)


def test_no_room_for_the_larger_buffers_keeps_512(demo_model, monkeypatch):
    # the demo model's weights, KV cache and buffers come to well under 1 GiB: the headroom alone leaves no room
    assert _resolve(demo_model, monkeypatch, DEFAULT_MARGIN_BYTES + 64 * MiB, n_gpu_layers="all").n_ubatch == 512


def test_no_gpu_keeps_512(demo_model, monkeypatch):
    monkeypatch.setattr(launch, "probe_gpus", lambda: ((), "no CUDA device"))
    p = launch.resolve_ubatch(demo_model, EngineParams(n_ubatch=None, n_gpu_layers="all"), print)
    assert p.n_ubatch == 512
