"""--moe-cache in the plan, no GPU: the flag's forms and its usage error, the per-layer floor (off with a note), an
explicit cache reserved before layers are placed, `auto` sized from the headroom less the margin, --explain's rows
and JSON agreeing with the plan, the probe's searches unchanged by `auto` and its command carrying the size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gguf_io import ModelConfig, open_gguf
from hybrid.cli.main import app
from hybrid.engine.fit import cache_alternative, probe_n_cpu_moe
from hybrid.engine.params import EngineParams
from hybrid.plan.budget import plan_for
from hybrid.plan.explain import plan_rows
from hybrid.plan.moe_cache import (AUTO_MARGIN_BYTES, InvalidMoeCache, MoeCacheRequest, cache_bytes, parse_moe_cache,
                                   resolve)
from hybrid.plan.overrides import cpu_moe_overrides
from hybrid.system.sizes import GiB, MiB

MOE = Path(__file__).parent / "fixtures" / "arch" / "qwen3moe-q4_k_m.gguf"  # 4 layers, 8 experts, 2 used
UNLIMITED = 1 << 62


def _model():
    with open_gguf(MOE) as f:
        return ModelConfig.from_gguf(f), dict(f.tensors)


def _plan(cfg, tensors, budget, cache="0", n_cpu_moe=4, ngl="all"):
    inputs = EngineParams(n_ctx=256, overrides=cpu_moe_overrides(n_cpu_moe=n_cpu_moe), moe_cache=cache).plan_inputs()
    return plan_for(cfg, tensors, budget, ngl, inputs)


@pytest.mark.parametrize("text,want", [("auto", MoeCacheRequest("auto")), ("32", MoeCacheRequest("slots", 32)),
                                       ("6GiB", MoeCacheRequest("bytes", 6 * GiB)), ("0", MoeCacheRequest()),
                                       ("off", MoeCacheRequest()), (" 512 MiB ", MoeCacheRequest("bytes", 512 * MiB))])
def test_the_flags_forms(text, want):
    assert parse_moe_cache(text) == want


@pytest.mark.parametrize("text", ["banana", "-3", "1.5", "auto2", "6GiBs"])
def test_a_bad_value_is_refused(text):
    with pytest.raises(InvalidMoeCache, match="--moe-cache takes"):
        parse_moe_cache(text)


def test_a_bad_value_is_a_one_line_usage_error():
    res = CliRunner().invoke(app, ["run", str(MOE), "--moe-cache", "banana", "-p", "x"])
    assert res.exit_code == 2 and "'banana'" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["run", str(MOE), "--moe-cache-policy", "fifo", "-p", "x"])
    assert res.exit_code == 2 and "lru" in res.output


def test_fewer_than_top_k_plus_one_slots_is_off_with_a_note():
    cfg, tensors = _model()
    off = resolve(MoeCacheRequest("slots", cfg.n_expert_used), tensors, [0, 1], cfg.n_expert, cfg.n_expert_used)
    assert not off.on and off.bytes == 0 and "fewer than top_k + 1 = 3" in off.note
    on = resolve(MoeCacheRequest("slots", 99), tensors, [0, 1], cfg.n_expert, cfg.n_expert_used)
    assert on.slots == cfg.n_expert and on.bytes == cache_bytes(tensors, [0, 1], cfg.n_expert, cfg.n_expert)
    none = resolve(MoeCacheRequest("auto"), tensors, [], cfg.n_expert, cfg.n_expert_used, 10 * GiB)
    assert not none.on and "no GPU layer keeps its routed experts in RAM" in none.note


def test_a_size_buys_whole_slots_in_every_layer():
    cfg, tensors = _model()
    layers = [0, 1, 2, 3]
    four = cache_bytes(tensors, layers, cfg.n_expert, 4)
    assert resolve(MoeCacheRequest("bytes", four), tensors, layers, cfg.n_expert, 2).slots == 4
    assert resolve(MoeCacheRequest("bytes", four - 1), tensors, layers, cfg.n_expert, 2).slots == 3
    # gate, up and down of (slots + 1) experts a layer (the zero slot), and the int32 table
    per = sum(tensors[f"blk.0.ffn_{p}_exps.weight"].nbytes // cfg.n_expert for p in ("gate", "up", "down"))
    assert four >= 4 * (4 + 1) * per + 4 * 4 * cfg.n_expert


def test_an_explicit_cache_counts_in_the_plan_and_in_what_fits():
    cfg, tensors = _model()
    base = _plan(cfg, tensors, UNLIMITED)
    cached = _plan(cfg, tensors, UNLIMITED, "4")
    assert cached.moe_cache.slots == 4 and cached.moe_cache.layers == (0, 1, 2, 3)
    assert cached.gpu_total_bytes == base.gpu_total_bytes + cached.moe_cache.bytes
    t = plan_rows(cached)
    assert t.gpu_bytes == cached.gpu_total_bytes and any(r.name == "expert cache" for r in t.rows)
    assert any("moe cache: 4 slots" in r for r in cached.reasons)
    # a budget that holds every layer but not the cache too: auto places fewer layers, and the plan fits
    tight = _plan(cfg, tensors, base.gpu_total_bytes + cached.moe_cache.bytes // 2, "4", ngl="auto")
    assert tight.n_gpu_layers < cfg.n_layer + 1 and tight.gpu_total_bytes <= tight.budget_bytes
    # only GPU layers keep experts in RAM: fewer of them, a smaller cache
    assert set(tight.moe_cache.layers) <= {lp.index for lp in tight.layers if lp.device == "gpu"}


def test_auto_takes_the_headroom_less_the_margin():
    cfg, tensors = _model()
    base = _plan(cfg, tensors, UNLIMITED)
    three = cache_bytes(tensors, [0, 1, 2, 3], cfg.n_expert, 3)
    p = _plan(cfg, tensors, base.gpu_total_bytes + AUTO_MARGIN_BYTES + three, "auto")
    assert p.moe_cache.slots == 3 and p.headroom_bytes >= AUTO_MARGIN_BYTES
    assert p.n_gpu_layers == base.n_gpu_layers  # auto never costs a layer
    big = _plan(cfg, tensors, base.gpu_total_bytes + 4 * GiB, "auto")
    assert big.moe_cache.slots == cfg.n_expert  # never more than every expert
    small = _plan(cfg, tensors, base.gpu_total_bytes + AUTO_MARGIN_BYTES, "auto")
    assert not small.moe_cache.on and "fewer than top_k + 1" in small.moe_cache.note
    assert small.gpu_total_bytes == base.gpu_total_bytes


def test_the_probes_search_ignores_auto():
    cfg, tensors = _model()
    budget = _plan(cfg, tensors, UNLIMITED, n_cpu_moe=2).gpu_total_bytes + 1
    plain = probe_n_cpu_moe(cfg, tensors, EngineParams(n_ctx=256), budget, margin_bytes=0)
    auto = probe_n_cpu_moe(cfg, tensors, EngineParams(n_ctx=256, moe_cache="auto"), budget, margin_bytes=0)
    assert (auto.predicted, auto.recommended) == (plain.predicted, plain.recommended) == (2, 2)


def test_probe_reports_the_auto_size_in_its_command():
    cfg, tensors = _model()
    budget = _plan(cfg, tensors, UNLIMITED).gpu_total_bytes + GiB + 600 * MiB
    res = CliRunner().invoke(app, ["probe", str(MOE), "-c", "256", "--dry-run", "--vram-budget", str(budget),
                                   "--n-cpu-moe", "4", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["recommended_ngl"] == cfg.n_layer + 1
    assert r["moe_cache"]["slots"] == cfg.n_expert and f"--moe-cache {cfg.n_expert}" in r["command"]


def test_the_cache_alternative_puts_every_expert_in_ram_and_caches_in_what_frees():
    cfg, tensors = _model()
    all_ram = _plan(cfg, tensors, UNLIMITED)  # --n-cpu-moe 4: every layer's experts in RAM
    five = cache_bytes(tensors, [0, 1, 2, 3], cfg.n_expert, 5)
    budget = all_ram.gpu_total_bytes + AUTO_MARGIN_BYTES + five
    alt = cache_alternative(cfg, tensors, EngineParams(n_ctx=256), budget, cfg.n_layer + 1)
    assert alt is not None and alt.moe_cache.slots == 5 and alt.n_cpu_moe == cfg.n_layer
    assert alt.gpu_total_bytes <= budget - AUTO_MARGIN_BYTES
    # no room for top_k + 1 slots a layer: no alternative; nor over an explicit -ot or cache size
    assert cache_alternative(cfg, tensors, EngineParams(n_ctx=256), all_ram.gpu_total_bytes + AUTO_MARGIN_BYTES,
                             cfg.n_layer + 1) is None
    assert cache_alternative(cfg, tensors, EngineParams(n_ctx=256, moe_cache="4"), budget, cfg.n_layer + 1) is None


def test_probe_prints_the_cache_alternative_only_when_it_exists():
    cfg, tensors = _model()
    budget = _plan(cfg, tensors, UNLIMITED, n_cpu_moe=2).gpu_total_bytes + 1  # 2 layers' experts in RAM at least
    res = CliRunner().invoke(app, ["probe", str(MOE), "-c", "256", "--dry-run", "--vram-budget", str(budget),
                                   "--margin", "0", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["recommended_n_cpu_moe"] == 2
    assert r["cache_alternative"] is None  # what --cpu-moe frees is far below auto's margin on this small model


def test_explain_json_shows_the_cache():
    res = CliRunner().invoke(app, ["run", str(MOE), "--explain", "--json", "--vram-budget", "4GiB", "-ngl", "all",
                                   "--n-cpu-moe", "4", "-c", "256", "--moe-cache", "2"])
    assert res.exit_code == 0, res.output
    j = json.loads(res.stdout)
    assert j["moe_cache"]["slots"] == 0 and "fewer than top_k + 1 = 3" in j["moe_cache"]["note"]
    res = CliRunner().invoke(app, ["run", str(MOE), "--explain", "--json", "--vram-budget", "4GiB", "-ngl", "all",
                                   "--n-cpu-moe", "4", "-c", "256", "--moe-cache", "5"])
    j = json.loads(res.stdout)
    assert j["moe_cache"]["slots"] == 5 and j["moe_cache"]["bytes"] > 0


def test_bench_sweeps_the_cache_and_reports_its_fields():
    """On the CPU (no GPU layer, so no cache): the rows of `--moe-cache auto,0` carry the fields, empty."""
    res = CliRunner().invoke(app, ["bench", "-m", str(MOE), "-p", "0", "-n", "2", "-r", "1", "-t", "1",
                                   "--moe-cache", "auto,0", "-o", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("["):])
    assert [r["moe_cache"] for r in rows] == ["auto", "0"]
    assert all(r["moe_cache_hit_rate"] is None and r["moe_cache_slots"] == 0 for r in rows)
    bad = CliRunner().invoke(app, ["bench", "-m", str(MOE), "--moe-cache", "auto,banana"])
    assert bad.exit_code == 2 and "banana" in bad.output


def test_bench_fields_count_each_test_apart():
    """cache_fields over a stand-in engine holding a real CacheBook: each row counts only what ran since the last."""
    from types import SimpleNamespace

    from hybrid.backends.moe_cache.book import CacheBook
    from hybrid.cli.bench_moe_cache import cache_counts, cache_fields, cache_note

    book = CacheBook((0,), 8, 2, 3, "lru", 2, (100,))
    engine = SimpleNamespace(backends=[SimpleNamespace(host_experts=SimpleNamespace(cache=SimpleNamespace(
        book=book, n_slots=3)))], output_backend=None)
    req = parse_moe_cache("auto")
    before = cache_counts(engine)
    book.decode(0, np.array([1, 2]), np.array([-1, -1]))  # 2 misses, 2 uploads
    row = cache_fields(engine, req, before)
    assert (row["moe_cache"], row["moe_cache_slots"], row["moe_cache_hit_rate"]) == ("auto", 3, 0.0)
    assert (row["moe_cache_uploads_per_token"], row["moe_cache_bytes_per_token"]) == (2.0, 200.0)
    before = cache_counts(engine)
    book.decode(0, np.array([1, 2]), np.array([0, 1]))  # both hit on the device
    row = cache_fields(engine, req, before)
    assert row["moe_cache_hit_rate"] == 1.0 and row["moe_cache_uploads_per_token"] == 0.0
    assert "3 slots, 100.0% hits" in cache_note(row) and "50.0%" in row["moe_cache_report"]
    none = cache_fields(SimpleNamespace(backends=[], output_backend=None), parse_moe_cache("0"), None)
    assert none["moe_cache_hit_rate"] is None and cache_note(none) == ""


def test_experts_with_biases_get_no_cache():
    """gpt-oss's experts carry biases, which the runtime's cached experts do not add: the plan reserves nothing for
    them and says why (so the probe recommends no --moe-cache for such a model)."""
    with open_gguf(MOE.parent / "gpt-oss-q4_k_m.gguf") as f:  # 8 experts, 4 used
        cfg, tensors = ModelConfig.from_gguf(f), dict(f.tensors)
    for cache in ("6", "auto"):
        p = _plan(cfg, tensors, UNLIMITED, cache, n_cpu_moe=cfg.n_layer)
        assert not p.moe_cache.on and p.moe_cache.bytes == 0 and "biases" in p.moe_cache.note, p.moe_cache
