"""`hybrid probe` and `-ngl auto` on an MoE model: the smallest --n-cpu-moe that fits with every other tensor on the
GPU, from the plan and from (here simulated) allocation attempts, against a brute-force walk over every N."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gguf_io import ModelConfig, open_gguf
from hybrid.cli.main import app
from hybrid.engine.fit import FitAttempt, probe_n_cpu_moe
from hybrid.engine.params import EngineParams
from hybrid.plan.budget import plan_for
from hybrid.plan.overrides import cpu_moe_overrides
from hybrid.system.sizes import MiB

MOE = Path(__file__).parent / "fixtures" / "arch" / "qwen3moe-q4_k_m.gguf"
UNLIMITED = 1 << 62


def _model():
    with open_gguf(MOE) as f:
        return ModelConfig.from_gguf(f), dict(f.tensors)


def _gpu_bytes(cfg, tensors, params: EngineParams, n: int) -> int:
    inputs = EngineParams(n_ctx=params.n_ctx, overrides=cpu_moe_overrides(n_cpu_moe=n)).plan_inputs()
    return plan_for(cfg, tensors, UNLIMITED, "all", inputs).gpu_total_bytes


def _small_experts_budget(cfg, tensors, params, n: int) -> int:
    """A budget where exactly N = n fits (the plan at n, plus half of one layer's experts)."""
    return (_gpu_bytes(cfg, tensors, params, n) + _gpu_bytes(cfg, tensors, params, n - 1)) // 2


@pytest.mark.parametrize("target", [2, 3, 4])  # (at N = 1 the upload slots outweigh one tiny layer's experts)
def test_the_plan_predicts_the_smallest_n_cpu_moe(target):
    cfg, tensors = _model()
    params = EngineParams(n_ctx=256)
    budget = _small_experts_budget(cfg, tensors, params, target)
    brute = min(n for n in range(cfg.n_layer + 1) if _gpu_bytes(cfg, tensors, params, n) <= budget)
    assert brute == target
    r = probe_n_cpu_moe(cfg, tensors, params, budget, margin_bytes=0)
    assert (r.predicted, r.measured, r.recommended, r.fits) == (target, None, target, True)
    # with a margin the recommendation moves up to the first N that leaves it
    margin = budget - _gpu_bytes(cfg, tensors, params, cfg.n_layer) - 1
    r = probe_n_cpu_moe(cfg, tensors, params, budget, margin_bytes=margin)
    assert r.recommended == cfg.n_layer and r.headroom_bytes >= margin


def test_the_measurement_overrules_the_plan_but_never_below_what_run_accepts():
    cfg, tensors = _model()
    params = EngineParams(n_ctx=256)
    budget = _small_experts_budget(cfg, tensors, params, 2)
    device = _small_experts_budget(cfg, tensors, params, 4)  # the device holds less than the plan thinks
    tried = []

    def fit(p: EngineParams) -> FitAttempt:
        n = sum(1 for o in p.overrides if not o.explicit)
        tried.append(n)
        assert p.n_gpu_layers == "all"
        return FitAttempt(-1, _gpu_bytes(cfg, tensors, params, n) <= device, 0)

    r = probe_n_cpu_moe(cfg, tensors, params, budget, margin_bytes=0, fit=fit)
    assert (r.predicted, r.measured, r.recommended) == (2, 4, 4)
    measured = [a.ngl for a in r.attempts if not a.error.startswith("refused by the plan")]
    assert measured == tried and len(set(tried)) == len(tried)  # each N once, reported as N
    # a device that holds more than the plan allows: the minimum is still one the plan (and so `run`) accepts
    tight = _gpu_bytes(cfg, tensors, params, cfg.n_layer) + 1  # only N = n_layer leaves the peak room
    r = probe_n_cpu_moe(cfg, tensors, params, tight, margin_bytes=0, fit=lambda p: FitAttempt(-1, True, 0))
    assert r.measured == cfg.n_layer
    refused = [a.ngl for a in r.attempts if "refused by the plan" in a.error]
    assert refused and all(not a.fits for a in r.attempts if a.ngl in refused)


def test_nothing_fits_when_the_rest_of_the_model_is_too_big():
    cfg, tensors = _model()
    params = EngineParams(n_ctx=256)
    budget = _gpu_bytes(cfg, tensors, params, cfg.n_layer) - 1
    r = probe_n_cpu_moe(cfg, tensors, params, budget, margin_bytes=0)
    assert not r.fits and r.predicted == cfg.n_layer + 1 and r.recommended == cfg.n_layer + 1


def test_probe_dry_run_recommends_n_cpu_moe_and_prints_the_command():
    cfg, tensors = _model()
    params = EngineParams(n_ctx=256)
    budget = _small_experts_budget(cfg, tensors, params, 2)
    res = CliRunner().invoke(app, ["probe", str(MOE), "-c", "256", "--dry-run", "--vram-budget", str(budget),
                                   "--margin", "0", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["moe"]["predicted"] == 2 and r["recommended_n_cpu_moe"] == 2
    assert r["recommended_ngl"] == cfg.n_layer + 1
    assert f"-ngl {cfg.n_layer + 1} --n-cpu-moe 2 -c 256" in r["command"]
    assert budget > 100 * MiB  # a sane budget: the overhead alone is 300 MiB
