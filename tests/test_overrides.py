"""Tensor overrides (-ot, --cpu-moe, --n-cpu-moe): the resolver against llama.cpp's rules for every tensor of the
fixture files, the order in which overrides are tried, bad input, and what the plan makes of them (bytes, the
per-tensor devices, the overrides it refuses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gguf_io import ModelConfig, open_gguf
from hybrid.errors import PlacementError
from hybrid.plan.budget import PlanInputs, plan_for
from hybrid.plan.overrides import (FFN_EXPS_REGEX, InvalidOverride, Override, build_overrides, describe,
                                   parse_override_tensor, resolve, resolve_all, unused)
from hybrid.system.sizes import GiB

ARCH = Path(__file__).parent / "fixtures" / "arch"
FILES = ["qwen3moe-q4_k_m.gguf", "qwen3moe-f16.gguf", "llama-q4_k_m.gguf", "qwen2-q4_k_m.gguf",
         "qwen3-q4_k_m.gguf"]

# llama.cpp's common/common.h, as written there: LLM_FFN_EXPS_REGEX and llm_ffn_block_regex's "blk\\.%d%s"
LLAMA_FFN_EXPS_REGEX = "\\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def _names(file: str) -> list[str]:
    with open_gguf(ARCH / file) as f:
        return list(f.tensors)


def _expert_layer(name: str) -> int | None:
    """The block of a routed-expert tensor, by reading the name (no regex): blk.N.ffn_{up,down,gate,gate_up}_
    {,ch}exps.*; None for any other tensor."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    field = parts[2]
    for proj in ("up", "down", "gate", "gate_up"):
        if field in (f"ffn_{proj}_exps", f"ffn_{proj}_chexps"):
            return int(parts[1])
    return None


def test_the_expert_pattern_is_llamas():
    assert FFN_EXPS_REGEX == LLAMA_FFN_EXPS_REGEX


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("n_cpu_moe", [0, 1, 3, 99])
def test_n_cpu_moe_moves_exactly_the_experts_of_the_first_blocks(file, n_cpu_moe):
    names = _names(file)
    got = resolve_all(names, build_overrides(n_cpu_moe=n_cpu_moe))
    want = {n: "CPU" for n in names if (il := _expert_layer(n)) is not None and il < n_cpu_moe}
    assert got == want
    if "moe" in file and n_cpu_moe:
        assert want  # the MoE file has expert tensors in those blocks


@pytest.mark.parametrize("file", FILES)
def test_cpu_moe_moves_every_expert_and_nothing_else(file):
    names = _names(file)
    got = resolve_all(names, build_overrides(cpu_moe=True))
    assert got == {n: "CPU" for n in names if _expert_layer(n) is not None}
    assert all("shexp" not in n and "gate_inp" not in n for n in got)


def test_block_numbers_do_not_match_their_prefixes():
    # blk.1 must not catch blk.10-19: llama.cpp's pattern has the dot after the number
    ov = build_overrides(n_cpu_moe=2)
    assert resolve("blk.1.ffn_up_exps.weight", ov) == "CPU"
    assert resolve("blk.10.ffn_up_exps.weight", ov) is None
    assert resolve("blk.12.ffn_gate_exps.weight", ov) is None
    assert resolve("blk.0.ffn_gate_up_exps.weight", ov) == "CPU"
    assert resolve("blk.0.ffn_up_chexps.weight", ov) == "CPU"
    assert resolve("blk.0.ffn_up_shexp.weight", ov) is None  # shared experts stay with their layer
    assert resolve("blk.0.ffn_gate_inp.weight", ov) is None  # the router too


def test_the_first_match_wins_and_explicit_ot_comes_first():
    ov = build_overrides(["blk\\.1\\.ffn_up_exps=CUDA0", "attn_q=CPU,attn_k=CUDA0"], cpu_moe=False, n_cpu_moe=2)
    assert [o.device for o in ov[:3]] == ["CUDA0", "CPU", "CUDA0"]
    assert resolve("blk.1.ffn_up_exps.weight", ov) == "CUDA0"  # -ot before --n-cpu-moe
    assert resolve("blk.1.ffn_down_exps.weight", ov) == "CPU"
    assert resolve("blk.5.attn_q.weight", ov) == "CPU" and resolve("blk.5.attn_k.weight", ov) == "CUDA0"
    assert describe(ov[:2]) == "blk\\.1\\.ffn_up_exps=CUDA0;attn_q=CPU" and describe(()) == "none"


def test_search_not_match():
    # std::regex_search: the pattern may match anywhere in the name
    assert resolve("blk.3.ffn_down_exps.weight", parse_override_tensor(["exps=CPU"])) == "CPU"
    assert resolve("blk.3.ffn_down_exps.weight", parse_override_tensor(["^exps=CPU"])) is None


@pytest.mark.parametrize("value,why", [
    ("exps", "expected REGEX=DEVICE"), ("=CPU", "expected REGEX=DEVICE"), ("exps=GPU", "unknown device 'GPU'"),
    ("exps=cuda0", "unknown device"), ("exps=CUDA1", "unknown device"), ("ffn_(up=CPU", "invalid regex"),
])
def test_bad_overrides_are_one_line_errors(value, why):
    with pytest.raises(InvalidOverride, match=re.escape(why)) as exc:
        parse_override_tensor([value])
    assert "\n" not in str(exc.value)


def test_unused_patterns_are_reported():
    names = _names("qwen3moe-q4_k_m.gguf")
    ov = parse_override_tensor(["exps=CPU", "nothing_like_this=CPU"])
    assert unused(names, ov) == (Override("nothing_like_this", "CPU"),)


# -- the plan ----------------------------------------------------------------------------------------------------
def _model(file: str):
    f = open_gguf(ARCH / file)
    return f, ModelConfig.from_gguf(f)


def _inputs(*ot, cpu_moe=False, n_cpu_moe=0) -> PlanInputs:
    return PlanInputs(n_ctx=256, overrides=build_overrides(list(ot), cpu_moe, n_cpu_moe))


def test_plan_with_overrides_moves_the_experts_bytes():
    f, cfg = _model("qwen3moe-q4_k_m.gguf")
    with f:
        n = cfg.n_layer
        base = plan_for(cfg, f.tensors, 64 * GiB, "all", _inputs())
        expert_bytes = [sum(t.nbytes for nm, t in f.tensors.items() if _expert_layer(nm) == il) for il in range(n)]
        for ov in (_inputs(cpu_moe=True), _inputs("exps=CPU"), _inputs(n_cpu_moe=n)):
            p = plan_for(cfg, f.tensors, 64 * GiB, "all", ov)
            assert all(l.device == "gpu" and l.experts_on_cpu for l in p.layers) and p.n_cpu_moe == n
            assert base.gpu_weight_bytes - p.gpu_weight_bytes == sum(expert_bytes)
        half = plan_for(cfg, f.tensors, 64 * GiB, "all", _inputs(n_cpu_moe=n // 2))
        assert [l.experts_on_cpu for l in half.layers] == [il < n // 2 for il in range(n)]
        # -ot naming some layers (not a prefix of the model) works the same way
        odd = plan_for(cfg, f.tensors, 64 * GiB, "all", _inputs("blk\\.[13]\\.ffn_.*_exps=CPU"))
        assert [l.index for l in odd.layers if l.experts_on_cpu] == [il for il in (1, 3) if il < n]


def test_every_tensors_device_adds_up_to_the_plan():
    f, cfg = _model("qwen3moe-q4_k_m.gguf")
    with f:
        for ngl, ov in (("all", _inputs(n_cpu_moe=2)), (3, _inputs(cpu_moe=True)), (0, _inputs())):
            p = plan_for(cfg, f.tensors, 64 * GiB, ngl, ov)
            gpu = sum(t.nbytes for nm, t in f.tensors.items() if p.tensor_device(nm) == "gpu")
            tied_copy = p.output.head_bytes if p.output.tied and p.output.device == "gpu" else 0
            assert gpu + tied_copy == p.gpu_weight_bytes
            cpu = sum(t.nbytes for nm, t in f.tensors.items() if p.tensor_device(nm) == "cpu")
            assert cpu == p.cpu_weight_bytes


@pytest.mark.parametrize("ot,why", [
    ("blk\\.0\\.ffn_up_exps=CPU", "keeps a layer's experts together"),  # one of a layer's three expert tensors
    ("blk\\.0\\.attn_q=CPU", "attn_q.weight=CPU is not supported"),  # a GPU layer's attention
    ("^output_norm=CPU", "the output layer is on the GPU"),  # (this fixture ties output to token_embd)
    ("token_embd=CUDA0", "token_embd.weight stays on the CPU"),
])
def test_overrides_hybrid_cannot_carry_out_are_refused(ot, why):
    f, cfg = _model("qwen3moe-q4_k_m.gguf")
    with f, pytest.raises(PlacementError, match=re.escape(why)):
        plan_for(cfg, f.tensors, 64 * GiB, "all", _inputs(ot))


def test_experts_to_the_gpu_need_their_layer_there():
    f, cfg = _model("qwen3moe-q4_k_m.gguf")
    with f:
        plan_for(cfg, f.tensors, 64 * GiB, "all", _inputs("exps=CUDA0"))  # where they go anyway: fine
        plan_for(cfg, f.tensors, 64 * GiB, 0, _inputs("exps=CPU"))  # likewise
        with pytest.raises(PlacementError, match="layer 0 is on the CPU"):
            plan_for(cfg, f.tensors, 64 * GiB, 1, _inputs("exps=CUDA0"))


def test_a_tight_budget_fits_more_layers_with_experts_in_ram():
    f, cfg = _model("qwen3moe-q4_k_m.gguf")
    with f:
        full = plan_for(cfg, f.tensors, 64 * GiB, "all", _inputs())
        budget = full.gpu_total_bytes - 1
        assert plan_for(cfg, f.tensors, budget, "auto", _inputs()).n_gpu_layers < cfg.n_layer + 1
        assert plan_for(cfg, f.tensors, budget, "auto", _inputs(cpu_moe=True)).n_gpu_layers == cfg.n_layer + 1


# -- the engine places what the plan says (a stand-in GPU records the uploads) -----------------------------------
class _RecordingGpu:
    name = "gpu (recorded)"

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.uploaded: list[str] = []
        self.host_experts = SimpleNamespace(min_batch=None, register=lambda layers: "")

    def limit_memory(self, budget: int) -> None:
        self.budget = budget

    def upload(self, w):
        self.uploaded.append(w.name)
        return w


def _load(monkeypatch, file: str, **params):
    import hybrid.backends.gpu as gpu_mod
    from hybrid.engine import Engine, EngineParams

    monkeypatch.setattr(gpu_mod, "GpuBackend", _RecordingGpu)
    return Engine.load(ARCH / file, EngineParams(n_ctx=64, n_gpu_layers="all", vram_budget=8 * GiB, repack=False,
                                                 **params))


def test_the_engine_keeps_the_overridden_experts_in_ram(monkeypatch):
    eng = _load(monkeypatch, "qwen3moe-q4_k_m.gguf", overrides=build_overrides(n_cpu_moe=2))
    try:
        gpu = eng.backends[0]
        layer_tensors = [nm for nm in eng.gguf.tensors if nm.startswith("blk.")]
        in_ram = {nm for nm in layer_tensors if (il := _expert_layer(nm)) is not None and il < 2}
        assert len(in_ram) == 6
        assert sorted(nm for nm in gpu.uploaded if nm.startswith("blk.")) == sorted(set(layer_tensors) - in_ram)
        assert all(isinstance(be, _RecordingGpu) for be in eng.backends)
        assert [lp.experts_on_cpu for lp in eng.placement.layers] == [il < 2 for il in range(eng.config.n_layer)]
    finally:
        eng.close()


def test_experts_in_ram_need_a_cpu_moe_kernel(monkeypatch):
    """Any routing may keep its experts in RAM (the gated forms route on the host); float experts may not (the
    CPU's MoE kernel takes the integer-dot types)."""
    from hybrid.errors import UnsupportedPlacement

    eng = _load(monkeypatch, "glm4moe-q4_k_m.gguf", overrides=build_overrides(cpu_moe=True))
    try:
        assert any(lp.experts_on_cpu for lp in eng.placement.layers)
    finally:
        eng.close()
    with pytest.raises(UnsupportedPlacement, match="no CPU MoE kernel"):
        _load(monkeypatch, "glm4moe-f16.gguf", overrides=build_overrides(cpu_moe=True))


def test_bench_sweeps_n_cpu_moe_and_writes_llama_bench_fields():
    import json as _json

    from typer.testing import CliRunner

    from hybrid.cli.main import app

    res = CliRunner().invoke(app, ["bench", "-m", str(ARCH / "qwen3moe-q4_k_m.gguf"), "-p", "8", "-n", "2", "-r", "1",
                                   "-ncmoe", "0,2", "-ot", "blk\\.3\\.ffn_.*_exps=CPU", "-o", "json"])
    assert res.exit_code == 0, res.output
    rows = _json.loads(res.stdout)
    assert [r["n_cpu_moe"] for r in rows] == [0, 0, 2, 2]
    assert all(r["tensor_buft_overrides"] == r["override_tensors"] == "blk\\.3\\.ffn_.*_exps=CPU" for r in rows)
    assert all(r["moe_experts"] == "" for r in rows)  # no GPU here: every layer on the CPU, nothing to report
    bad = CliRunner().invoke(app, ["bench", "-m", str(ARCH / "qwen3moe-q4_k_m.gguf"), "-ot", "exps=GPU"])
    assert bad.exit_code == 2 and "unknown device 'GPU'" in bad.output
