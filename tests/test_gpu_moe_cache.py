"""The runtime expert cache on the device (--moe-cache, backends/moe_cache/runtime.py): with it on, decode (through
CUDA graphs with host breaks) agrees with the same placement without it within the GPU-vs-CPU bounds of
tests/test_gpu_host_experts.py, greedy ids agree on the qwen3moe fixtures, hits happen, the cap holds every step,
multi-token batches insert nothing, and once the copies are done the device table and the slots hold exactly what
the host's book says."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from hybrid.backends.moe_cache.runtime import expert_cache  # noqa: E402
from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.sampling import log_softmax  # noqa: E402
from hybrid.plan.overrides import build_overrides  # noqa: E402
from hybrid.tools.synth.model import ModelShape, make_model  # noqa: E402
from test_golden_arch import agreement  # noqa: E402
from test_gpu_host_experts import assert_agree_to_first_tie, greedy  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024, n_swa=32)
KL_MAX = 0.2  # as tests/test_gpu_host_experts.py: the CPU's and the GPU's 8-bit activations differ by roundings
KL_MEDIAN = 2e-2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("moecache") / "qwen3moe-q4_k_m.gguf"
    make_model(path, "qwen3moe", SHAPE, "Q4_K_M", seed=12, threads=4)  # 8 experts, 2 used
    return path


def _engine(path, cache="0", inserts=2, policy="lru", n_ctx=192, ubatch=96):
    eng = Engine.load(path, EngineParams(n_ctx=n_ctx, n_batch=ubatch, n_ubatch=ubatch, n_gpu_layers="all",
                                         op_offload=True, overrides=build_overrides((), True, 0), moe_cache=cache,
                                         moe_cache_policy=policy, moe_cache_inserts=inserts))
    if cache != "0":
        assert expert_cache(eng) is not None, "the cache was not attached (experts not page-locked?)"
    return eng


def _kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    pa = np.exp(a)
    return (pa * (a - b)).sum(-1)


def _seq(seed: int, n: int = 96) -> np.ndarray:
    seq = np.random.default_rng(seed).integers(3, SHAPE.n_vocab, n)
    seq[0] = 1
    return seq


def _decode(eng, seq, n: int = 32, cap: int | None = None):
    """Log-probs of seq[:n] token by token; with a cache, checks after every token that no layer uploaded more
    than `cap` experts."""
    cache, out = eng.new_cache(), []
    c = expert_cache(eng)
    for t in seq[:n]:
        before = None if c is None else c.book.stats.uploads.copy()
        out.append(eng.eval([int(t)], cache))
        if c is not None and cap is not None:
            assert (c.book.stats.uploads - before <= cap).all(), (c.book.stats.uploads, before)
    return log_softmax(np.stack(out))


@pytest.mark.parametrize("slots,inserts,policy", [(3, 1, "lru"), (4, 2, "lru"), (6, 2, "lfru"), (8, -1, "lfu")])
def test_cache_on_matches_cache_off(moe_model, slots, inserts, policy):
    seq = _seq(7)
    off = _engine(moe_model)
    try:
        ref = _decode(off, seq)
    finally:
        off.close()
    eng = _engine(moe_model, str(slots), inserts, policy)
    try:
        dec = _decode(eng, seq, cap=None if inserts < 0 else inserts)
        gpus = {id(b): b for b in eng.backends if hasattr(b, "decode_step")}.values()
        reports = [(b.graph_report(), b.graph_fallback) for b in gpus]
        s = expert_cache(eng).book.stats
        assert expert_cache(eng).n_slots == slots
    finally:
        eng.close()
    assert reports and not any(fb for _, fb in reports) and "captured" in reports[0][0], reports
    assert s.tokens == 32 and (s.steps == 32).all() and s.lookups.sum() == 32 * 2 * SHAPE.n_layer
    assert s.hits.sum() > 0 and s.uploads.sum() > 0, s  # a warm cache serves some experts from the GPU
    kd = _kl(ref, dec)
    assert np.isfinite(dec).all()
    assert np.median(kd) < KL_MEDIAN and (kd < KL_MAX).mean() >= 0.95, (np.median(kd), kd.max())


def test_every_expert_cached_serves_all_hits(moe_model):
    """8 slots of 8 experts, no cap: after the first tokens every expert is resident and nearly every lookup hits."""
    eng = _engine(moe_model, "8", -1)
    try:
        _decode(eng, _seq(3), n=48)
        s = expert_cache(eng).book.stats
        hits0, looks0 = s.hits.sum(), s.lookups.sum()
        _decode(eng, _seq(4), n=16)
        assert (s.hits.sum() - hits0) / (s.lookups.sum() - looks0) > 0.9, (s.hits, s.lookups)
    finally:
        eng.close()


def test_multi_token_batches_insert_nothing(moe_model):
    eng = _engine(moe_model, "4", 2, ubatch=160)
    try:
        c = expert_cache(eng)
        cache = eng.new_cache()
        eng.eval(_seq(5, 96), cache)  # a prompt below the upload threshold: the CPU path, bypassing the cache
        eng.eval(_seq(6, 160), eng.new_cache())  # above it: experts uploaded for the batch, not into the cache
        eng.eval(_seq(8, 4), cache, logits_from=0)  # a speculative check: served (hits on the GPU), no inserts
        eng.eval(_seq(9, 4), cache, logits_from=0)
        s = c.book.stats
        assert s.uploads.sum() == 0 and s.steps.sum() == 0 and s.batches == 2 * SHAPE.n_layer, s
        assert all((ls.slot_of < 0).all() and ls.clock == 0 for ls in c.book.slots)
        for t in _seq(10, 6):
            eng.eval([int(t)], cache)
        assert s.uploads.sum() > 0 and (s.steps == 6).all()
    finally:
        eng.close()


def test_the_device_table_and_slots_match_the_book(moe_model):
    eng = _engine(moe_model, "4", 2, policy="lfru")
    try:
        _decode(eng, _seq(11), n=40)
        c = expert_cache(eng)
        c.wait()  # every copy done and entered in the table
        table = c.table.get()
        for row, il in enumerate(c.book.layers):
            ls = c.book.slots[row]
            np.testing.assert_array_equal(table[row], ls.slot_of)
            lw = eng.weights.layers[il]
            for (pool, _), name in zip(c.pools[row], ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                dev = pool.get()
                host = lw[name].raw
                for slot, e in enumerate(ls.expert_in.tolist()):
                    if e >= 0:
                        np.testing.assert_array_equal(dev[slot], host[e])
                assert not dev[c.n_slots].any()  # the zero slot stays zero
    finally:
        eng.close()


def test_add_misses_adds_the_hosts_sum_only_after_a_miss():
    from kernels_gpu.moe_cache import add_misses

    rng = np.random.default_rng(1)
    hits = rng.standard_normal((2, 64)).astype(np.float32)
    cpu = rng.standard_normal((2, 64)).astype(np.float32)
    found = np.array([[3, 0, 7], [1, 2, 5]], dtype=np.int32)
    got = add_misses(cupy.asarray(hits), cupy.asarray(cpu), cupy.asarray(found)).get()
    np.testing.assert_array_equal(got, hits)  # all hits: the host's buffer (stale here) is not read
    found[1, 2] = -1
    got = add_misses(cupy.asarray(hits), cupy.asarray(cpu), cupy.asarray(found)).get()
    np.testing.assert_array_equal(got, hits + cpu)


def test_lookup_kernel_matches_its_reference():
    from kernels_gpu.moe_cache import lookup, lookup_reference

    rng = np.random.default_rng(0)
    table = np.full(64, -1, dtype=np.int32)
    table[rng.choice(64, 20, replace=False)] = rng.permutation(20)
    ids = rng.integers(0, 64, (5, 8)).astype(np.int32)
    wts = rng.random((5, 8)).astype(np.float32)
    got = [a.get() for a in lookup(cupy.asarray(table), cupy.asarray(ids), cupy.asarray(wts), 20)]
    for g, w in zip(got, lookup_reference(table, ids, wts, 20)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", ["qwen3moe-q4_k_m", "qwen3moe-skew-q4_k"])
def test_greedy_ids_agree_with_the_cache_off(fixtures_dir, name):
    """Greedy continuation on the fixture, every layer's experts in RAM: the cache on (3 slots, the floor, and
    every expert) against off, equal up to the first near tie of the reference (as test_gpu_host_experts)."""
    path = fixtures_dir / "arch" / f"{name}.gguf"
    prompt = list(range(1, 17))
    outs = {}
    for cache in ("0", "3", "8"):
        eng = _engine(path, cache, 2, n_ctx=64)
        try:
            outs[cache] = greedy(eng, prompt, 16)
            if cache != "0":
                assert expert_cache(eng).book.stats.hits.sum() > 0
        finally:
            eng.close()
    assert_agree_to_first_tie(outs, "0")


def test_golden_fixture_decoded_through_the_cache(fixtures_dir):
    """llama.cpp's top-20 log-probs on the skewed fixture, every position decoded token by token (the cache serves
    decode only) with --cpu-moe --moe-cache 4: the bounds of test_gpu_host_experts' golden test (top-1 >= 0.75,
    median KL < 5e-2, PPL within 3%), on the first two chunks."""
    name = "qwen3moe-skew-q4_k"
    ref = np.load(fixtures_dir / "arch" / f"{name}.GPL-3.npz")
    engine = _engine(fixtures_dir / "arch" / f"{name}.gguf", "4", 2, n_ctx=128, ubatch=128)
    try:
        top1, kl, ppl = agreement(engine, ref, chunks=2, token_by_token=True)
        hits = expert_cache(engine).book.stats.hits.sum()
    finally:
        engine.close()
    assert hits > 0
    assert top1 >= 0.75 and np.median(kl) < 5e-2, (top1, np.median(kl))
    want = float(ref["ppl_running"][1])  # llama.cpp's running PPL after the same two chunks
    assert abs(ppl / want - 1) < 0.03, (ppl, want)
