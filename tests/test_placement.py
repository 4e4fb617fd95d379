"""placement.plan: -ngl semantics, KV first, output layer then the last layers, buffers, MoE, SWA, errors, rows."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_factory import tiny_model, write_gguf
from gguf_io import GGML_TYPE_IDS, GGML_TYPES, ModelConfig, TensorInfo, open_gguf
from hybrid.errors import HybridError, PlacementError
from hybrid.plan.placement import (GPU_OVERHEAD_BYTES, PlacementPlan, kv_bytes_per_cell, kv_cells,
                              plan, scratch_bytes)
from hybrid.plan.explain import plan_rows
from hybrid.system.sizes import GiB, MiB

# -- synthetic big models: TensorInfo tables of real shapes, Q4_K_M-like types ---------------------------------
LLAMA_8B = dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256)
QWEN_32B = dict(n_layer=64, n_embd=5120, n_head=40, n_head_kv=8, n_ff=27648, n_vocab=152064)
BUDGETS = [3 * GiB, 4 * GiB, 6 * GiB, 12 * GiB, 24 * GiB]


def tensor(name: str, ne: tuple[int, ...], type_name: str) -> TensorInfo:
    block, size = GGML_TYPES[GGML_TYPE_IDS[type_name]][1:]
    n = math.prod(ne)
    return TensorInfo(name, ne, GGML_TYPE_IDS[type_name], type_name, 0, n // block * size, n)


def make_config(*, n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, head_dim=None, tied=False, n_swa=0,
                swa_layers=None, n_expert=0, n_expert_used=0, n_ff_exp=0, arch="llama") -> ModelConfig:
    hd = head_dim or n_embd // n_head
    return ModelConfig(
        arch=arch, name="synthetic", n_vocab=n_vocab, n_ctx_train=131072, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=hd, n_embd_head_v=hd, n_ff=n_ff, n_rot=hd,
        rope_type="norm", rope_freq_base=500000.0, rope_freq_base_swa=500000.0, rope_freq_scale=1.0,
        rope_scaling_type="linear", f_norm_rms_eps=1e-5, f_attention_scale=1 / math.sqrt(hd), n_swa=n_swa,
        swa_layers=swa_layers or (False,) * n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp, attn_logit_softcapping=None, final_logit_softcapping=None, tied_output=tied,
        file_type=15,
    )


def make_tensors(*, n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, tied=False, **_) -> dict[str, TensorInfo]:
    """Q4_K_M's mix: Q4_K matrices, Q6_K for attn_v, ffn_down and output, F32 norms."""
    hd = n_embd // n_head
    ts = [tensor("token_embd.weight", (n_embd, n_vocab), "Q4_K")]
    for i in range(n_layer):
        p = f"blk.{i}."
        ts += [tensor(p + "attn_norm.weight", (n_embd,), "F32"),
               tensor(p + "attn_q.weight", (n_embd, n_head * hd), "Q4_K"),
               tensor(p + "attn_k.weight", (n_embd, n_head_kv * hd), "Q4_K"),
               tensor(p + "attn_v.weight", (n_embd, n_head_kv * hd), "Q6_K"),
               tensor(p + "attn_output.weight", (n_head * hd, n_embd), "Q4_K"),
               tensor(p + "ffn_norm.weight", (n_embd,), "F32"),
               tensor(p + "ffn_gate.weight", (n_embd, n_ff), "Q4_K"),
               tensor(p + "ffn_up.weight", (n_embd, n_ff), "Q4_K"),
               tensor(p + "ffn_down.weight", (n_ff, n_embd), "Q6_K")]
    ts.append(tensor("output_norm.weight", (n_embd,), "F32"))
    if not tied:
        ts.append(tensor("output.weight", (n_embd, n_vocab), "Q6_K"))
    return {t.name: t for t in ts}


def model(shape: dict, **kw) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    return make_config(**shape, **kw), make_tensors(**shape, **kw)


def from_file(path: Path) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    with open_gguf(path) as f:
        return ModelConfig.from_gguf(f), dict(f.tensors)


def tiny(tmp_path: Path, arch: str, **kw) -> tuple[ModelConfig, dict[str, TensorInfo]]:
    md, ts = tiny_model(arch, **kw)
    return from_file(write_gguf(tmp_path / f"{arch}.gguf", md, ts))


def total_bytes(tensors) -> int:
    return sum(t.nbytes for t in tensors.values())


# -- the synthetic tables are the size of the real files -------------------------------------------------------
def test_synthetic_shapes_weigh_like_q4_k_m_files():
    assert 4.5e9 < total_bytes(make_tensors(**LLAMA_8B)) < 5.2e9  # Meta-Llama-3-8B Q4_K_M: 4.92 GB
    assert 18.5e9 < total_bytes(make_tensors(**QWEN_32B)) < 21.5e9  # Qwen2.5-32B Q4_K_M: 19.85 GB (Q6_K in
    # only half the ffn_down there; here in all)


# -- budgets, contexts, KV types ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN_32B], ids=["8B", "32B"])
@pytest.mark.parametrize("n_ctx", [4096, 32768])
def test_auto_is_monotonic_in_budget_and_q8_0_fits_at_least_f16(shape, n_ctx):
    cfg, ts = model(shape)
    n_max = cfg.n_layer + 1
    by_type = {}
    for kv in ("f16", "q8_0"):
        ngls = []
        for budget in BUDGETS:
            p = plan(cfg, ts, budget, "auto", n_ctx, kv, kv)
            assert p.gpu_total_bytes <= budget and p.headroom_bytes == budget - p.gpu_total_bytes
            assert p.max_fit_ngl == p.n_gpu_layers
            if p.n_gpu_layers < n_max:  # the largest: one more layer does not fit
                nxt = plan(cfg, ts, 1 << 62, p.n_gpu_layers + 1, n_ctx, kv, kv)
                assert nxt.gpu_total_bytes > budget
                if nxt.gpu_total_bytes - nxt.scratch.slack > budget:  # an explicit -ngl: only when even the
                    with pytest.raises(PlacementError):  # live buffers do not fit
                        plan(cfg, ts, budget, p.n_gpu_layers + 1, n_ctx, kv, kv)
            ngls.append(p.n_gpu_layers)
        assert ngls == sorted(ngls), ngls
        by_type[kv] = ngls
    assert all(q >= f for q, f in zip(by_type["q8_0"], by_type["f16"])), by_type
    if shape is QWEN_32B and n_ctx == 32768:  # 8 GiB of f16 KV against 4.25 GiB of q8_0
        assert by_type["q8_0"][-1] > by_type["f16"][-1]


def test_known_fits():
    cfg, ts = model(LLAMA_8B)
    assert plan(cfg, ts, 24 * GiB, "auto", 4096).n_gpu_layers == 33  # everything, with room to spare
    assert plan(cfg, ts, 3 * GiB, "auto", 4096).n_gpu_layers < 20
    big, bts = model(QWEN_32B)
    assert plan(big, bts, 24 * GiB, "auto", 4096).n_gpu_layers == 65  # 18.5 GiB of weights + 1 GiB KV
    assert plan(big, bts, 24 * GiB, "auto", 32768).n_gpu_layers < 65  # + 8 GiB of f16 KV does not


def test_kv_cache_is_reserved_for_every_gpu_layer():
    cfg, ts = model(LLAMA_8B)
    per_layer = 32768 * cfg.n_head_kv * 128 * 2 * 2  # K and V, f16
    assert kv_bytes_per_cell(cfg) * 32768 == per_layer
    for k in (1, 2, 10, 33):
        p = plan(cfg, ts, 64 * GiB, k, 32768)
        gpu = [l for l in p.layers if l.device == "gpu"]
        assert len(gpu) == k - 1 and p.gpu_kv_bytes == per_layer * (k - 1)
        assert all(l.kv_bytes == per_layer for l in p.layers)
        assert p.cpu_kv_bytes == per_layer * (cfg.n_layer - k + 1)
        assert p.gpu_total_bytes == p.gpu_weight_bytes + p.gpu_kv_bytes + p.gpu_scratch_bytes + p.overhead_bytes
    # 8 GiB holds every weight and buffer, but not with the 4 GiB cache as well: the cache costs layers
    everything = plan(cfg, ts, 64 * GiB, "all", 32768)
    assert everything.gpu_total_bytes - everything.gpu_kv_bytes < 8 * GiB < everything.gpu_total_bytes
    p = plan(cfg, ts, 8 * GiB, "auto", 32768)
    assert p.n_gpu_layers < 33 and p.reasons[1].startswith("KV cache reserved first")


def test_output_layer_first_then_the_last_repeating_layers():
    cfg, ts = model(LLAMA_8B)
    n = cfg.n_layer
    for k in range(n + 2):
        p = plan(cfg, ts, 64 * GiB, k, 4096)
        assert p.n_gpu_layers == k
        assert p.output.device == ("gpu" if k >= 1 else "cpu")
        assert p.gpu_layer_indices == tuple(range(n + 1 - k, n))  # llama.cpp: i_gpu_start = n_layer + 1 - ngl
        assert p.i_gpu_start == n + 1 - k
    one = plan(cfg, ts, 64 * GiB, 1, 4096)
    assert one.gpu_weight_bytes == ts["output.weight"].nbytes + ts["output_norm.weight"].nbytes


def test_too_many_layers_is_one_line_with_the_numbers():
    cfg, ts = model(LLAMA_8B)
    fit = plan(cfg, ts, 6 * GiB, "auto", 32768).n_gpu_layers
    with pytest.raises(PlacementError) as e:
        plan(cfg, ts, 6 * GiB, "all", 32768)
    msg = str(e.value)
    m = re.fullmatch(r"33 layers need at least ([\d.]+) GiB of the 6\.0 GiB VRAM budget \(weights [\d.]+ GiB, "
                     r"KV cache [\d.]+ GiB, buffers [\d.]+ MiB\); (\d+) fit", msg)
    assert m, msg
    assert float(m.group(1)) > 6.0 and int(m.group(2)) == fit
    with pytest.raises(PlacementError, match=r"^1 layer needs at least .* of the 0 B VRAM budget .*; 0 fit$"):
        plan(cfg, ts, 0, 1, 4096)


def test_close_numbers_are_shown_with_enough_digits():
    cfg, ts = model(LLAMA_8B)
    p = plan(cfg, ts, 64 * GiB, 33, 4096)
    need = p.gpu_total_bytes - p.scratch.slack  # the least 33 layers need: refused below it
    with pytest.raises(PlacementError) as e:
        plan(cfg, ts, need - 1 * MiB, "all", 4096)
    need_s, budget_s = re.search(r"need at least (\S+ \S+) of the (\S+ \S+)", str(e.value)).groups()
    assert need_s != budget_s


@pytest.mark.parametrize("budget", [0, None, 24 * GiB])
def test_ngl_0_is_cpu_only(budget):
    cfg, ts = model(LLAMA_8B)
    p = plan(cfg, ts, budget, 0, 4096)
    assert p.n_gpu_layers == 0 and p.gpu_layer_indices == () and p.output.device == "cpu"
    assert p.gpu_total_bytes == 0 and p.scratch.total == 0 and p.overhead_bytes == 0
    assert p.headroom_bytes == (budget or 0)
    assert p.cpu_weight_bytes == total_bytes(ts)
    assert p.cpu_kv_bytes == cfg.n_layer * 4096 * kv_bytes_per_cell(cfg)
    if not budget:  # no GPU: auto is CPU-only too
        auto = plan(cfg, ts, budget, "auto", 4096)
        assert dataclasses.replace(auto, requested_ngl=0, reasons=()) == dataclasses.replace(p, reasons=())
        assert auto.reasons[0] == "auto: no VRAM budget, everything on the CPU"


@pytest.mark.parametrize("ngl", ["all", "ALL", 33, 999, "999"])
def test_all_layers(ngl):
    cfg, ts = model(LLAMA_8B)
    p = plan(cfg, ts, 24 * GiB, ngl, 4096)
    assert p.n_gpu_layers == 33 and p.i_gpu_start == 0 and p.cpu_kv_bytes == 0
    assert p.cpu_weight_bytes == p.embedding_bytes == ts["token_embd.weight"].nbytes  # the embedding stays


def test_tied_output_needs_a_gpu_copy_of_token_embd():
    cfg, ts = model(LLAMA_8B, tied=True)
    assert "output.weight" not in ts
    embd, norm = ts["token_embd.weight"].nbytes, ts["output_norm.weight"].nbytes
    on = plan(cfg, ts, 64 * GiB, 1, 4096)
    assert on.output.tied and on.output.weight_bytes == embd + norm == on.gpu_weight_bytes
    assert on.embedding_bytes == embd and on.cpu_weight_bytes == total_bytes(ts) - norm  # the CPU keeps its own
    off = plan(cfg, ts, 64 * GiB, 0, 4096)
    assert off.output.weight_bytes == norm and off.cpu_weight_bytes == total_bytes(ts)
    untied_cfg, untied = model(LLAMA_8B)
    # a tied Q4_K head is smaller than the untied Q6_K one: no double counting, no forgetting
    assert plan(untied_cfg, untied, 64 * GiB, 1, 4096).gpu_weight_bytes - on.gpu_weight_bytes == (
        untied["output.weight"].nbytes - embd)
    assert any("a GPU copy of it" in r for r in on.reasons)


def test_n_cpu_moe_keeps_the_experts_of_the_first_layers_in_ram(tmp_path):
    cfg, ts = tiny(tmp_path, "qwen3moe", n_layer=4, n_embd=64, n_ff_exp=64, n_expert=8, weight_type="F16")
    experts = [sum(t.nbytes for n, t in ts.items() if n.startswith(f"blk.{i}.") and "_exps" in n) for i in range(4)]
    assert all(experts)
    base = plan(cfg, ts, 64 * GiB, "all", 256)
    moe = plan(cfg, ts, 64 * GiB, "all", 256, n_cpu_moe=2)
    assert [l.experts_on_cpu for l in moe.layers] == [True, True, False, False]
    assert all(l.device == "gpu" for l in moe.layers)  # attention and the router stay on the GPU
    assert base.gpu_weight_bytes - moe.gpu_weight_bytes == experts[0] + experts[1]
    assert moe.cpu_weight_bytes - base.cpu_weight_bytes == experts[0] + experts[1]
    assert moe.gpu_kv_bytes == base.gpu_kv_bytes
    everything = plan(cfg, ts, 64 * GiB, "all", 256, n_cpu_moe=99)
    assert everything.gpu_weight_bytes == base.gpu_weight_bytes - sum(experts)
    assert any("routed experts of 2 GPU layers stay in RAM, run by the CPU (layers 0-1" in r for r in moe.reasons)
    # a tight budget fits at least as many layers when experts stay behind
    budget = base.gpu_total_bytes - 1
    tight = plan(cfg, ts, budget, "auto", 256).n_gpu_layers
    assert tight < 5 and plan(cfg, ts, budget, "auto", 256, n_cpu_moe=4).n_gpu_layers == 5
    rows = plan_rows(moe)
    cpu_experts = [r.name for r in rows.rows if r.device == "cpu" and "experts" in r.name]
    assert cpu_experts == ["blk.0 experts", "blk.1 experts"]
    assert rows.gpu_bytes == moe.gpu_total_bytes and rows.cpu_bytes == moe.cpu_total_bytes


def test_sliding_window_layers_keep_only_the_window(tmp_path):
    cfg, ts = tiny(tmp_path, "gemma3", n_layer=6, n_embd=64, n_head=2, n_head_kv=1, head_dim=64)
    assert cfg.n_swa == 16 and cfg.swa_layers == (True,) * 5 + (False,)
    assert [kv_cells(cfg, il, 4096, 512) for il in range(6)] == [768] * 5 + [4096]  # pad(16 + 512, 256)
    assert kv_cells(cfg, 0, 300, 512) == 300  # never more than n_ctx
    assert kv_cells(cfg, 0, 4096, 512, swa_full=True) == 4096
    p = plan(cfg, ts, 64 * GiB, "all", 4096)
    per = kv_bytes_per_cell(cfg)
    assert p.gpu_kv_bytes == (5 * 768 + 4096) * per
    assert plan(cfg, ts, 64 * GiB, "all", 4096, swa_full=True).gpu_kv_bytes == 6 * 4096 * per


def test_scratch_in_the_plan():
    """The plan counts scratch_bytes' pool high-water mark (by hand in test_placement_scratch.py) once."""
    cfg, ts = model(LLAMA_8B)
    s = scratch_bytes(cfg, 4096, 512, True, 33, 4096)
    p = plan(cfg, ts, 64 * GiB, "all", 4096)
    assert p.scratch == s and p.gpu_scratch_bytes == s.total == s.peak + s.slack
    assert p.overhead_bytes == GPU_OVERHEAD_BYTES
    assert s.logits > s.activations  # the output layer's T x n_vocab logits and their GEMM chunks are the peak
    no_fa = plan(cfg, ts, 64 * GiB, "all", 4096, flash_attn=False).scratch
    assert no_fa.activations > s.activations and no_fa.logits == s.logits  # the KQ scores
    assert plan(cfg, ts, 64 * GiB, 1, 4096).scratch.activations == 0  # the output layer alone
    no_overhead = plan(cfg, ts, 64 * GiB, "all", 4096, overhead_bytes=0)
    assert no_overhead.gpu_total_bytes == p.gpu_total_bytes - GPU_OVERHEAD_BYTES
    assert plan(cfg, ts, 64 * GiB, "all", 4096, n_ubatch=2048).gpu_scratch_bytes > s.total


@pytest.mark.parametrize("bad", [dict(type_k="q5_1"), dict(type_v="f8"), dict(ngl=-1), dict(ngl="lots"),
                                 dict(ngl=True), dict(n_ctx=0), dict(n_ubatch=0), dict(budget_bytes=-1)])
def test_bad_arguments_are_value_errors(bad):
    cfg, ts = model(LLAMA_8B)
    args = dict(budget_bytes=GiB, ngl="auto", n_ctx=4096) | bad
    with pytest.raises(ValueError):
        plan(cfg, ts, **args)


def test_quantized_kv_needs_head_size_divisible_by_32():
    cfg, ts = model(dict(LLAMA_8B, n_embd=40 * 32), head_dim=40)
    plan(cfg, ts, GiB, "auto", 512, "f16", "f16")
    with pytest.raises(ValueError, match="divisible by 32"):
        plan(cfg, ts, GiB, "auto", 512, "q8_0", "q8_0")


def test_kv_type_bytes():
    cfg, _ = model(LLAMA_8B)
    f16 = kv_bytes_per_cell(cfg, "f16", "f16")
    assert kv_bytes_per_cell(cfg, "f32", "f32") == 2 * f16
    assert kv_bytes_per_cell(cfg, "q8_0", "q8_0") * 64 == f16 * 34
    assert kv_bytes_per_cell(cfg, "Q4_0", "q4_0") * 64 == f16 * 18
    assert kv_bytes_per_cell(cfg, "q8_0", "f16") * 128 == f16 * (34 + 64)
    with pytest.raises(HybridError, match="found 'bf16'"):  # the planner takes only the types the engine stores
        kv_bytes_per_cell(cfg, "bf16", "bf16")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(budget=st.integers(0, 12 * GiB), n_ctx=st.sampled_from([256, 4096, 32768]),
       kv=st.sampled_from(["f16", "q8_0", "q4_0"]), ub=st.sampled_from([1, 512, 2048]), fa=st.booleans())
def test_auto_is_the_largest_ngl_that_fits(budget, n_ctx, kv, ub, fa):
    cfg, ts = _LLAMA
    auto = plan(cfg, ts, budget, "auto", n_ctx, kv, kv, ub, fa)
    k = auto.n_gpu_layers
    assert auto.gpu_total_bytes <= budget
    if k < 33:
        nxt = plan(cfg, ts, 1 << 62, k + 1, n_ctx, kv, kv, ub, fa)
        assert nxt.gpu_total_bytes > budget
        if nxt.gpu_total_bytes - nxt.scratch.slack > budget:  # an explicit -ngl: refused when even the live
            with pytest.raises(PlacementError, match=f"; {k} fit$"):  # buffers do not fit
                plan(cfg, ts, budget, k + 1, n_ctx, kv, kv, ub, fa)
        else:
            assert plan(cfg, ts, budget, k + 1, n_ctx, kv, kv, ub, fa).max_fit_ngl == k
    if k > 0:
        assert plan(cfg, ts, budget, k - 1, n_ctx, kv, kv, ub, fa).max_fit_ngl == k


_LLAMA = model(LLAMA_8B)


# -- real files ------------------------------------------------------------------------------------------------
def _fixture_models(fixtures_dir: Path) -> list[Path]:
    return sorted((fixtures_dir / "arch").glob("*.gguf"))


def test_fixture_models_plan_and_explain(fixtures_dir):
    paths = _fixture_models(fixtures_dir)
    assert paths
    for path in paths:
        cfg, ts = from_file(path)
        prev = -1
        for budget in (0, 300 * MiB, 400 * MiB, GiB):
            p = plan(cfg, ts, budget, "auto", 4096)
            assert p.n_gpu_layers >= prev and p.gpu_total_bytes <= budget
            prev = p.n_gpu_layers
            _check_rows(p, ts)
        _check_rows(plan(cfg, ts, 64 * GiB, "all", 4096, "q8_0", "q4_0", n_cpu_moe=1), ts)


def test_demo_model(demo_model):
    cfg, ts = from_file(demo_model)
    p = plan(cfg, ts, 2 * GiB, "auto", 32768)
    assert p.n_gpu_layers == 19 and p.output.tied
    swa = [l for l in p.layers if l.swa]
    assert swa and all(l.kv_cells == 1024 for l in swa)  # 512-token window + one ubatch, padded to 256
    assert all(l.kv_cells == 32768 for l in p.layers if not l.swa)
    assert p.scratch.logits > 512 * 262144 * 4 > p.scratch.activations  # the 262k vocabulary's logits dominate
    _check_rows(p, ts)


def _check_rows(p: PlacementPlan, ts) -> None:
    for collapse in (False, True):
        t = plan_rows(p, collapse=collapse)
        assert t.gpu_bytes == p.gpu_total_bytes and t.cpu_bytes == p.cpu_total_bytes
        assert t.headroom_bytes == p.headroom_bytes and t.n_offloadable == p.n_layer + 1
        assert {r.device for r in t.rows} <= {"gpu", "cpu"}
    rows = plan_rows(p).rows
    assert rows[0].name == "token_embd" and rows[0].device == "cpu"
    assert sum(r.weight_bytes for r in rows if r.name.startswith("blk.")) == sum(l.weight_bytes for l in p.layers)
    # every weight byte is somewhere: the file's bytes, plus a tied head's GPU copy
    weight_rows = sum(r.weight_bytes for r in rows if r.name not in ("compute buffers", "overhead"))
    copy = p.output.head_bytes if p.output.tied and p.output.device == "gpu" else 0
    assert weight_rows == total_bytes(ts) + copy
    assert all("\n" not in r for r in p.reasons)


def test_collapsed_rows_name_ranges():
    cfg, ts = model(LLAMA_8B)
    p = plan(cfg, ts, 64 * GiB, 10, 4096)
    names = [(r.name, r.device) for r in plan_rows(p, collapse=True).rows]
    assert names == [("token_embd", "cpu"), ("blk.0-22", "cpu"), ("blk.23-31", "gpu"), ("output", "gpu"),
                     ("compute buffers", "gpu"), ("overhead", "gpu")]
    assert len(plan_rows(p).rows) == 1 + 32 + 1 + 2
