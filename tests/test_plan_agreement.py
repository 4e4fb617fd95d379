"""`hybrid run --explain`, `hybrid probe` and the engine that `hybrid run` loads show the same bytes for the same
flags: one plan builder (hybrid.plan.budget.plan_for) serves all three, op offload's buffers included."""

from __future__ import annotations

from types import SimpleNamespace

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.system.sizes import MiB

ROOT = Path(__file__).resolve().parents[1]
CTX = "4096"


def cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "hybrid", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def explain(model: str, *flags: str) -> dict:
    return cli("run", model, "--explain", "--json", "-c", CTX, *flags)


@pytest.fixture(scope="module")
def model(fixtures_dir) -> str:
    return str(fixtures_dir / "arch" / "qwen3-q4_k_m.gguf")


@pytest.mark.parametrize("offload", [[], ["--no-op-offload"]], ids=["op-offload", "no-op-offload"])
@pytest.mark.parametrize("budget", ["380MiB", "2GiB"])
def test_probe_recommends_the_plan_explain_shows(model, budget, offload):
    p = cli("probe", model, "--dry-run", "--vram-budget", budget, "-c", CTX, "--margin", "4MiB", "--json", *offload)
    e = explain(model, "-ngl", str(p["recommended_ngl"]), "--vram-budget", budget, *offload)
    assert e["n_gpu_layers"] == p["recommended_ngl"]
    assert (e["gpu_total_bytes"], e["cpu_total_bytes"]) == (p["plan_gpu_bytes"], p["plan_cpu_bytes"])


def test_explain_counts_op_offload_buffers_on_a_split(model):
    """The bug this fixed: --explain left out op offload's buffers that the engine's plan counts."""
    on = explain(model, "-ngl", "2", "--vram-budget", "2GiB")
    off = explain(model, "-ngl", "2", "--vram-budget", "2GiB", "--no-op-offload")
    full = explain(model, "-ngl", "all", "--vram-budget", "2GiB")
    assert on["gpu_total_bytes"] > off["gpu_total_bytes"]  # the stream slots, one layer's KV cache, the vectors
    assert full["devices"] == ["gpu"] * full["n_offloadable"] and on["devices"].count("gpu") == 2


class _RecordingGpu:
    """Stands in for GpuBackend where there is no GPU: the engine's planning and placement run for real, the
    uploads keep the host arrays (nothing is evaluated here)."""

    name = "gpu (recorded)"

    def free_bytes(self) -> int:
        raise AssertionError("the budget is given, the device is not asked")

    def limit_memory(self, budget: int) -> None:
        self.budget = budget

    def __init__(self) -> None:
        self.host_experts = SimpleNamespace(min_batch=None)  # what the engine sets for experts kept in RAM

    def upload(self, w):
        return w


@pytest.mark.parametrize("ngl", ["1", "3", "all"])
def test_the_engine_plans_what_explain_shows(model, ngl, monkeypatch):
    import hybrid.backends.gpu as gpu_mod

    monkeypatch.setattr(gpu_mod, "GpuBackend", _RecordingGpu)
    budget = 2048 * MiB
    e = explain(model, "-ngl", ngl, "--vram-budget", "2GiB", "--no-op-offload")
    eng = Engine.load(model, EngineParams(n_ctx=int(CTX), n_gpu_layers=ngl, vram_budget=budget, repack=False))
    try:
        pl = eng.placement
        assert (pl.gpu_total_bytes, pl.cpu_total_bytes, pl.n_gpu_layers) == (
            e["gpu_total_bytes"], e["cpu_total_bytes"], e["n_gpu_layers"])
        on_gpu = [il for il, be in enumerate(eng.backends) if isinstance(be, _RecordingGpu)]
        assert [d == "gpu" for d in e["devices"][:-1]] == [il in on_gpu for il in range(eng.config.n_layer)]
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("ngl", ["2", "all"])
def test_on_the_gpu_run_plans_what_explain_shows(model, ngl):
    """On a real device, op offload on (the CLI's default): the loaded engine's plan is the one --explain shows."""
    e = explain(model, "-ngl", ngl, "--vram-budget", "2GiB")
    eng = Engine.load(model, EngineParams(n_ctx=int(CTX), n_gpu_layers=ngl, vram_budget=2048 * MiB, op_offload=True))
    try:
        pl = eng.placement
        assert (pl.gpu_total_bytes, pl.cpu_total_bytes, pl.n_gpu_layers) == (
            e["gpu_total_bytes"], e["cpu_total_bytes"], e["n_gpu_layers"])
        assert (eng.op_offload is not None) == (ngl != "all")
    finally:
        eng.close()
