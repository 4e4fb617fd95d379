"""Routing traces (hybrid/backends/moe_cache/trace.py, `hybrid trace-experts`): the ids and weights recorded are
the model's routing (a numpy reference from the router weights; the fused CPU path equal to the op-by-op one bit
for bit, observing changes no logit), the .npz format, the summary, a skewed synthetic model's skew seen in its
trace, and on the GPU the same routing on every placement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.backends.cpu import CpuBackend
from hybrid.backends.moe_cache.stats import entropy_bits, routing_summary, top_cs, top_share
from hybrid.backends.moe_cache.trace import ExpertTrace, RoutingRecorder, record_trace
from hybrid.engine import Engine, EngineParams
from hybrid.errors import HybridError
from hybrid.model.arch.moe import moe_layer
from hybrid.tools.synth.model import ModelShape, make_model, router_row_scales

ROOT = Path(__file__).resolve().parents[1]
SKEW_SHAPE = ModelShape(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024, n_expert=32,
                        n_expert_used=4, n_ff_exp=64)


@pytest.fixture(scope="module")
def moe_path(fixtures_dir) -> Path:
    return fixtures_dir / "arch" / "qwen3moe-q4_k_m.gguf"


def _chunks(n_vocab: int, n: int, size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, n_vocab, size - 1).tolist()] for _ in range(n)]


def _reference_routing(h: np.ndarray, router: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Softmax routing in float64 -> (ids (n, k) by falling p, renormalized weights, margin p_k - p_{k+1})."""
    z = h.astype(np.float64) @ router.astype(np.float64).T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    order = np.argsort(-p, axis=1, kind="stable")
    top = np.take_along_axis(p, order[:, :k + 1], axis=1)
    return order[:, :k], top[:, :k] / top[:, :k].sum(axis=1, keepdims=True), top[:, k - 1] - top[:, k]


def test_the_trace_is_the_routing_the_fused_path_ran(moe_path, monkeypatch):
    seen: dict[int, list[np.ndarray]] = {}
    used: list[bool] = []
    fused = CpuBackend.fused_moe

    def spy(be, spec, cfg, lw, h, residual=None):
        seen.setdefault(moe_layer(lw), []).append(np.array(h))
        out = fused(be, spec, cfg, lw, h, residual)
        used.append(out is not None)
        return out

    monkeypatch.setattr(CpuBackend, "fused_moe", spy)
    eng = Engine.load(moe_path, EngineParams(n_ctx=96, n_batch=96, n_ubatch=48))
    try:
        cfg = eng.config
        trace = record_trace(eng, _chunks(cfg.n_vocab, 2, 96), "qwen3moe", 96)
        routers = {il: eng.weights.layers[il]["ffn_gate_inp"] for il in trace.layers.tolist()}
    finally:
        eng.close()
    assert used and all(used)  # every MoE layer ran the compiled routing
    assert trace.ids.shape == (192, cfg.n_layer, cfg.n_expert_used) and trace.ids.dtype == np.int16
    assert trace.layers.tolist() == list(range(cfg.n_layer)) and trace.chunk.tolist() == [0] * 96 + [1] * 96
    for il, w in routers.items():
        assert w.type_name == "F32"
        router = w.raw.view(np.float32).reshape(cfg.n_expert, cfg.n_embd)
        ids, weights, margin = _reference_routing(np.concatenate(seen[il]), router, cfg.n_expert_used)
        clear = margin > 1e-5  # a nearer tie may fall either way in float32
        assert clear.mean() > 0.95
        assert (trace.ids[clear, il] == ids[clear]).all(), il
        np.testing.assert_allclose(trace.weights[clear, il], weights[clear], rtol=2e-5, atol=1e-6)


def test_fused_and_op_by_op_traces_agree_and_observing_changes_nothing(moe_path):
    eng = Engine.load(moe_path, EngineParams(n_ctx=64, n_batch=64, n_ubatch=64))
    try:
        chunk = _chunks(eng.config.n_vocab, 1, 40, seed=3)[0]
        plain = eng.eval(chunk, eng.new_cache(), logits_from=0)
        rec = RoutingRecorder(eng.config.n_expert)
        with eng.observe_routing(rec):
            heard = eng.eval(chunk, eng.new_cache(), logits_from=0)
        assert all(b.routing_observer is None for b in eng.backends)
        np.testing.assert_array_equal(plain, heard)  # bit for bit: the observed path is the same arithmetic
        traces = {}
        for fused in (True, False):
            for n_batch in (40, 1):  # one call, and token by token (the few-token path)
                eng.backends[0].fused = fused  # every layer shares the one CpuBackend
                traces[fused, n_batch] = record_trace(eng, [chunk], "m", n_batch)
    finally:
        eng.close()
    for n_batch in (40, 1):
        a, b = traces[True, n_batch], traces[False, n_batch]
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.weights, b.weights)
    assert (traces[True, 40].ids == traces[True, 1].ids).mean() > 0.95


def test_observing_reaches_every_backend_and_is_cleared(moe_path):
    """Engine.observe_routing sets the hook on the layers' backends and on op offload's own GPU (-ngl 0), and
    clears it; the GPU's report copies device arrays to the host with the layer from the router's name (stand-ins
    for CuPy here: the GPU path itself runs in test_gpu_placements_trace_the_cpus_routing)."""
    from types import SimpleNamespace

    from hybrid.backends.gpu import GpuBackend
    from hybrid.backends.offload import OffloadBackend

    gpu = object.__new__(GpuBackend)  # no device: report_routing only needs _cupy.asnumpy
    gpu._cupy = SimpleNamespace(asnumpy=lambda a: np.array(a) * 1)
    offload = OffloadBackend(gpu, None, None)
    rec = RoutingRecorder(n_expert=8)
    eng = Engine.load(moe_path, EngineParams(n_ctx=16))
    try:
        eng.op_offload = SimpleNamespace(gpu=gpu)
        with eng.observe_routing(rec):
            assert eng.backends[0].routing_observer is rec and gpu.routing_observer is rec
            assert offload.routing_observer is rec
            lw = eng.weights.layers[2]
            gpu.report_routing(lw, np.array([[3, 1]], np.int32), np.array([[0.75, 0.25]], np.float32))
        assert eng.backends[0].routing_observer is None and gpu.routing_observer is None
        gpu.report_routing(lw, np.array([[0, 1]]), np.array([[0.5, 0.5]]))  # no observer: nothing heard
    finally:
        eng.op_offload = None
        eng.close()
    trace = rec.trace("m")
    assert trace.layers.tolist() == [2] and trace.ids[:, 0].tolist() == [[3, 1]]
    assert trace.weights[:, 0].tolist() == [[0.75, 0.25]]


def test_the_trace_file_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    rec = RoutingRecorder(n_expert=16)
    for chunk in range(2):
        rec.chunk_index = chunk
        for il in (1, 2):  # layer 0 dense: no column
            rec.routed(il, rng.integers(0, 16, (5, 4)), rng.random((5, 4)).astype(np.float32))
    trace = rec.trace("m")
    assert trace.ids.shape == (10, 2, 4) and trace.layers.tolist() == [1, 2]
    trace.save(tmp_path / "t.npz")
    back = ExpertTrace.load(tmp_path / "t.npz")
    for f in ("ids", "weights", "layers", "chunk"):
        np.testing.assert_array_equal(getattr(back, f), getattr(trace, f))
        assert getattr(back, f).dtype == getattr(trace, f).dtype
    assert (back.n_expert, back.model, back.top_k, back.n_tok) == (16, "m", 4, 10)
    counts = back.counts()
    assert counts.shape == (2, 16) and counts.sum() == 80
    assert counts[0, 3] == (back.ids[:, 0] == 3).sum()
    np.savez(tmp_path / "bad.npz", ids=np.zeros((2, 2)))
    with pytest.raises(HybridError, match="not an expert trace"):
        ExpertTrace.load(tmp_path / "bad.npz")
    rec.routed(1, np.zeros((1, 4)), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="different numbers of tokens"):
        rec.trace("m")


def test_summary_numbers():
    counts = np.array([8, 4, 2, 2, 0, 0, 0, 0])
    assert top_share(counts, 2) == 0.75 and entropy_bits(counts) == pytest.approx(1.75)
    assert top_cs(4, 32) == (4, 8) and top_cs(8, 128) == (8, 16, 32) and top_cs(2, 8) == (2, 4)
    ids = np.zeros((4, 1, 2), dtype=np.int16)
    ids[:, 0, 1] = [1, 2, 3, 4]
    s = routing_summary(ExpertTrace(ids, np.ones(ids.shape, np.float32), np.array([5], np.int32),
                                    np.zeros(4, np.int32), 8, "m"))
    lr = s.layers[0]
    assert lr.layer == 5 and lr.busiest[:2] == [(0, 4), (1, 1)] and lr.shares == (5 / 8, 7 / 8)
    assert lr.entropy_bits == pytest.approx(-(0.5 * np.log2(0.5) + 4 * 0.125 * np.log2(0.125)))
    assert lr.entropy_norm == pytest.approx(lr.entropy_bits / 3)
    assert json.loads(json.dumps(s.to_json()))["layers"][0]["top_share"]["2"] == 5 / 8


def test_a_skewed_models_trace_shows_its_skew(tmp_path):
    """make_model's --router-skew 1.0 against the same model unskewed (tests/test_synth_skew.py measured the same
    through the op-by-op routing: top-4 shares 0.29-0.48 even, 0.41-0.59 skewed)."""
    shares, hot = {}, {}
    for skew in (0.0, 1.0):
        path = tmp_path / f"skew{skew}.gguf"
        make_model(path, "qwen3moe", SKEW_SHAPE, "Q4_K_M", seed=3, threads=2, router_skew=skew)
        eng = Engine.load(path, EngineParams(n_ctx=128, n_batch=128, n_ubatch=128))
        try:
            trace = record_trace(eng, _chunks(SKEW_SHAPE.n_vocab, 2, 128, seed=1), "synthetic", 128)
        finally:
            eng.close()
        s = routing_summary(trace)
        assert s.cs == (4, 8)
        shares[skew] = np.array([lr.shares[0] for lr in s.layers])
        widest = [np.argsort(-np.array(router_row_scales(32, 1.0, il)))[:4] for il in range(SKEW_SHAPE.n_layer)]
        counts = trace.counts()
        hot[skew] = np.array([counts[il, widest[il]].sum() / counts[il].sum() for il in range(SKEW_SHAPE.n_layer)])
    assert (shares[1.0] > shares[0.0] + 0.05).all(), shares
    assert (hot[1.0] > 2 * hot[0.0]).all() and (hot[1.0] > 0.3).all(), hot  # the rows made wide are the hot ones


def _hybrid(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_cli_writes_the_trace_and_the_summary(moe_path, fixtures_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "trace.npz"
    r = _hybrid("trace-experts", str(moe_path), "-f", str(text), "-c", "64", "--chunks", "2", "-b", "32", "-o",
                str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    trace = ExpertTrace.load(out)
    assert trace.ids.shape == (128, 4, 2) and trace.model == summary["model"] and summary["n_tok"] == 128
    assert [lr["layer"] for lr in summary["layers"]] == [0, 1, 2, 3]
    assert sum(summary["layers"][0]["counts"]) == 256
    r = _hybrid("trace-experts", str(moe_path), "-f", str(text), "-c", "64", "--chunks", "1", "-o", str(out))
    assert r.returncode == 0 and "top-2 share" in r.stdout and "all" in r.stdout, r.stderr
    r = _hybrid("trace-experts", str(fixtures_dir / "arch" / "qwen3-q4_k_m.gguf"), "-f", str(text), "-c", "64",
                "-o", str(out))
    assert r.returncode == 1 and "without routed experts" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("ngl,n_cpu_moe,n_batch", [("all", 0, 96), ("all", 0, 1), ("all", 2, 96), ("all", 2, 1),
                                                   (0, 0, 96)])
def test_gpu_placements_trace_the_cpus_routing(moe_path, ngl, n_cpu_moe, n_batch):
    """GPU layers (device routing copied back; decode steps eager while tracing), experts in RAM beside them, and
    op offload's CPU layers on the GPU (-ngl 0, a 96-token batch) record the CPU's routing but for near ties."""
    from hybrid.plan.overrides import build_overrides

    chunks = _chunks(32000, 1, 96, seed=5)
    ref_eng = Engine.load(moe_path, EngineParams(n_ctx=96, n_batch=96, n_ubatch=96))
    try:
        ref = record_trace(ref_eng, chunks, "m", n_batch)
    finally:
        ref_eng.close()
    eng = Engine.load(moe_path, EngineParams(n_ctx=96, n_batch=96, n_ubatch=96, n_gpu_layers=ngl, op_offload=True,
                                             overrides=build_overrides((), False, n_cpu_moe)))
    try:
        trace = record_trace(eng, chunks, "m", n_batch)
        if ngl == 0:
            assert eng.op_offload is not None and eng.op_offload.batches > 0
        assert all(getattr(b, "routing_observer", None) is None for b in eng.backends)
    finally:
        eng.close()
    same = (np.sort(trace.ids, axis=2) == np.sort(ref.ids, axis=2)).all(axis=2)
    assert same.mean() > 0.95, same.mean()  # measured on the H200: 0.966 at the least (experts in RAM, decode)
    # the weights expert by expert: the GPU's hidden states differ from the CPU's by its fp16 GEMMs and q8 matvecs
    # (the bounds tests/test_gpu_host_experts.py holds the logits to), so the router's softmax moves a little
    by_id = [np.take_along_axis(t.weights, np.argsort(t.ids, axis=2), axis=2)[same] for t in (trace, ref)]
    d = np.abs(by_id[0] - by_id[1])
    assert np.median(d) < 1e-2 and np.quantile(d, 0.95) < 5e-2, (np.median(d), np.quantile(d, 0.95), d.max())


def test_cache_hit_rates_split_at_the_chunk_that_ends_half_the_tokens():
    from hybrid.backends.moe_cache.book import CacheBook
    from hybrid.cli.trace_experts import cache_hit_rates

    book = CacheBook((0,), 8, 2, 3, "lru", 2, (100,))
    st = book.stats
    st.hits[0], st.lookups[0] = 40, 60  # the counts at the end; after the first of two chunks: 10 of 20
    r = cache_hit_rates(book, [(50, 10, 20), (100, 40, 60)])
    assert r["second_half_hit_rate"] == 30 / 40 and r["hit_rate"] == 40 / 60 and r["slots"] == 3
    assert "decode hit rate" in r["summary"]
    assert cache_hit_rates(book, [(30, 1, 2), (100, 40, 60)])["second_half_hit_rate"] is None  # no chunk ends at 50
