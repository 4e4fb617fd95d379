"""Paged KV caches on the GPU (kernels_gpu.kv_cache.PagedArgs, hybrid.kv.paged): kv_store and attention through
block tables equal the contiguous cache's bit for bit (f16, q8_0, q4_0, blocks out of order; the decode kernel and
the tiled prefill kernel), a ragged batch of sequences in one decode launch equals each sequence alone, and the
engine's paged sequences equal contiguous caches: one alone (prefill and decode graphs), a decode batch of several
through the decode graphs (one launch a layer for their attention), a split model whose CPU and GPU layers share a
table, and the paged scheduler serving requests with its blocks all back afterwards.

Tolerances: the same kernels over the same keys give identical floats (asserted equal). A ragged launch splits the
keys across CTAs by its own token count, so its sums run in another order: rtol 1e-5. A decode batch multiplies
float activations (the matvec of several tokens) where one token takes 8-bit activations (quantize_q8_1 + dp4a), as
llama.cpp's CUDA backend does too, so batch-vs-alone logits are compared at 5% of the largest logit, and the top-1
token where the alone run's top-2 gap is clear (> 0.1)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.kv.paged import PagedKV  # noqa: E402
from hybrid.server.paged_scheduler import PagedScheduler  # noqa: E402
from hybrid.tools.synth.model import ModelShape, make_model  # noqa: E402
from kernels_gpu.attention import attention  # noqa: E402
from kernels_gpu.kv_cache import PagedArgs, alloc_kv_layer, kv_store  # noqa: E402
from test_serve_paged import _run  # noqa: E402 - every prompt through a scheduler, admitted as slots free up

pytestmark = pytest.mark.gpu

SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024)
BATCH_RTOL = 0.05  # of the largest logit: float vs 8-bit activations in the matvecs
CLEAR_GAP = 0.1  # a top-1 compared only where the reference's top-2 are this far apart


def _pool_and_table(type_kv, n_head_kv, d, bs, n_blocks, n_pos, rng):
    pool = alloc_kv_layer(n_blocks * bs, n_head_kv, d, d, type_kv, type_kv)
    table = rng.permutation(n_blocks)[: -(-n_pos // bs)].astype(np.int32)  # blocks out of order
    return pool, table


def _cells(table, bs, n):
    p = np.arange(n)
    return table[p // bs].astype(np.int64) * bs + p % bs


@pytest.mark.parametrize("type_kv", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("bs", [16, 64])
def test_paged_store_and_attention_equal_contiguous(type_kv, bs):
    rng = np.random.default_rng(3)
    n_head, n_head_kv, d, n = 8, 2, 128, 150
    contiguous = alloc_kv_layer(256, n_head_kv, d, d, type_kv, type_kv)
    pool, table = _pool_and_table(type_kv, n_head_kv, d, bs, 24, 256, rng)
    paged = PagedArgs(cupy.asarray(table.reshape(1, -1)), None, bs)
    k = cupy.asarray(rng.standard_normal((n, n_head_kv, d), dtype=np.float32))
    v = cupy.asarray(rng.standard_normal((n, n_head_kv, d), dtype=np.float32))
    pos = cupy.arange(n, dtype=cupy.int32)
    kv_store(contiguous, pos, k, v)
    kv_store(pool, pos, k, v, paged=paged)
    cells = cupy.asarray(_cells(table, bs, n))
    assert bool((pool.k[cells] == contiguous.k[:n]).all()) and bool((pool.v[cells] == contiguous.v[:n]).all())
    view = replace(pool, table=table, block_size=bs)
    for n_q, prefill in ((1, False), (4, False), (40, True), (40, False)):
        q = cupy.asarray(rng.standard_normal((n_q, n_head, d), dtype=np.float32))
        qp = cupy.arange(n - n_q, n, dtype=cupy.int32)
        want = attention(q, contiguous, qp, n, 0.1, prefill=prefill)
        got = attention(q, view, qp, n, 0.1, prefill=prefill, paged=paged)
        assert bool((got == want).all()), (n_q, prefill)
        swa = attention(q, view, qp, n, 0.1, n_swa=50, prefill=prefill, paged=paged)  # a window inside a block
        assert bool((swa == attention(q, contiguous, qp, n, 0.1, n_swa=50, prefill=prefill)).all())


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_ragged_decode_batch_in_one_launch_equals_each_sequence_alone(dynamic):
    rng = np.random.default_rng(4)
    n_head, n_head_kv, d, bs = 8, 2, 64, 32
    lengths = [5, 70, 33, 129]
    pool = alloc_kv_layer(40 * bs, n_head_kv, d, d, "q8_0", "q8_0")
    perm = rng.permutation(40).astype(np.int32)
    width = 6
    tables = np.full((len(lengths), width), -1, dtype=np.int32)
    alone, keys = [], []
    start = 0
    for s, n in enumerate(lengths):
        nb = -(-n // bs)
        tables[s, :nb] = perm[start:start + nb]
        start += nb
        k = cupy.asarray(rng.standard_normal((n, n_head_kv, d), dtype=np.float32))
        v = cupy.asarray(rng.standard_normal((n, n_head_kv, d), dtype=np.float32))
        keys.append((k, v))
        c = alloc_kv_layer(width * bs, n_head_kv, d, d, "q8_0", "q8_0")
        kv_store(c, cupy.arange(n, dtype=cupy.int32), k, v)
        alone.append(c)
    paged = PagedArgs(cupy.asarray(tables), cupy.arange(len(lengths), dtype=cupy.int32), bs)
    # the sequences' keys but their last, a sequence at a time; then every last one in one ragged store
    for s, n in enumerate(lengths):
        k, v = keys[s]
        kv_store(pool, cupy.arange(n - 1, dtype=cupy.int32), k[:-1], v[:-1], paged=paged.one(s))
    last = cupy.asarray(np.array([n - 1 for n in lengths], dtype=np.int32))
    kv_store(pool, last, cupy.concatenate([k[-1:] for k, _ in keys]), cupy.concatenate([v[-1:] for _, v in keys]),
             paged=paged)
    for s, n in enumerate(lengths):
        cells = cupy.asarray(_cells(tables[s], bs, n))
        assert bool((pool.k[cells] == alone[s].k[:n]).all()), s
    q = cupy.asarray(rng.standard_normal((len(lengths), n_head, d), dtype=np.float32))
    n_kv = width * bs if dynamic else max(lengths)
    got = cupy.asnumpy(attention(q, pool, last, n_kv, 0.125, dynamic=dynamic, paged=paged))
    for s, n in enumerate(lengths):
        want = cupy.asnumpy(attention(q[s:s + 1], alone[s], last[s:s + 1], n, 0.125))
        np.testing.assert_allclose(got[s:s + 1], want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpupaged") / "llama-q4_k_m.gguf"
    make_model(path, "llama", SHAPE, "Q4_K_M", seed=23, threads=4)
    return path


@pytest.fixture(scope="module", params=["all", 2], ids=["ngl-all", "ngl-2"])
def engine(request, model):
    e = Engine.load(model, EngineParams(n_ctx=512, n_batch=512, n_ubatch=512, n_gpu_layers=request.param))
    yield e
    e.close()


def _scrambled_pool(engine, n_blocks, bs=32):
    """A pool whose free list is out of order (blocks taken and given back), so tables are not 0, 1, 2, ..."""
    kv = PagedKV(engine.config, engine.backends, n_blocks, bs, engine.params.type_k, engine.params.type_v)
    held = [kv.sequence(bs * n_blocks) for _ in range(3)]
    for i, s in enumerate(held):
        s.reserve(bs * (i + 2))
    held[1].release()
    return kv, held


def test_a_paged_sequence_gives_the_contiguous_caches_logits(engine):
    kv, _ = _scrambled_pool(engine, 32)
    seq, ref = kv.sequence(256), engine.new_cache(256, paged=False)
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, SHAPE.n_vocab, 45)]
    a, b = engine.eval(prompt, seq), engine.eval(prompt, ref)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))
    for _ in range(8):  # decode steps: the second and later replay a CUDA graph (the table crosses with x)
        t = int(np.argmax(b))
        a, b = engine.eval([t], seq), engine.eval([t], ref)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))
    assert seq.n_past == ref.n_past == len(prompt) + 8


def test_each_runs_own_pool_replays_the_same_decode_graph(engine):
    """Engine.new_cache gives each `run` a paged sequence with a pool of its own: the decode graph captured on the
    first replays on the later ones (the pools' addresses cross in the graph's slots, as a contiguous cache's do),
    and each gives a contiguous cache's logits. The caches stay alive, so every pool has its own address, and each
    has its own prompt, so a graph reading another pool's keys would be seen."""
    gpu = next(be for be in engine.backends if be.name == "gpu")
    kept = []
    for round_ in range(3):
        prompt = [int(t) for t in np.random.default_rng(9 + round_).integers(3, SHAPE.n_vocab, 30)]
        run, ref = engine.new_cache(200), engine.new_cache(200, paged=False)
        assert run.paged and not ref.paged
        il = engine.backends.index(gpu)  # a GPU layer's pool
        assert all(run.layers[il].k.data.ptr != r.layers[il].k.data.ptr for r, _ in kept)
        a, b = engine.eval(prompt, run), engine.eval(prompt, ref)
        replays = _replays(gpu)
        for _ in range(6):
            t = int(np.argmax(b))
            a, b = engine.eval([t], run), engine.eval([t], ref)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()), err_msg=f"run {round_}")
        if round_:
            assert _replays(gpu) - replays >= 12  # both caches' steps replayed graphs captured in the first run
        kept.append((run, ref))
    for run, ref in kept:  # the later runs left the earlier pools alone
        a, b = engine.eval([5], run), engine.eval([5], ref)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))
    assert not gpu.graph_fallback, gpu.graph_report()


def _close(got, want):
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= BATCH_RTOL * scale
    top2 = np.sort(want)[-2:]
    if float(top2[1] - top2[0]) > CLEAR_GAP:
        assert int(np.argmax(got)) == int(np.argmax(want))


def _replays(gpu) -> int:
    """CUDA graph replays of the backend so far (its runner exists from its first decode step)."""
    return gpu._graphs.stats.replays if gpu._graphs is not None else 0


def test_a_decode_batch_through_the_graphs_gives_each_sequence_its_own_logits(engine):
    rng = np.random.default_rng(7)
    kv, _ = _scrambled_pool(engine, 64)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.n_vocab, n)] for n in (5, 17, 33, 60)]
    seqs = [kv.sequence(256) for _ in prompts]
    refs = [engine.new_cache(256, paged=False) for _ in prompts]
    got = engine.eval_batch(list(zip(prompts, seqs)))  # a ragged prefill (eager)
    want = [engine.eval(p, c) for p, c in zip(prompts, refs)]
    for g, w in zip(got, want):
        _close(g, w)
    gpu = next(be for be in engine.backends if be.name == "gpu")
    replays = _replays(gpu)
    for _ in range(6):  # the same tokens for both (the reference's greedy ones)
        toks = [int(np.argmax(w)) for w in want]
        got = engine.eval_batch([([t], s) for t, s in zip(toks, seqs)])
        want = [engine.eval([t], c) for t, c in zip(toks, refs)]
        for g, w in zip(got, want):
            _close(g, w)
    assert _replays(gpu) - replays >= 4 * 6 + 4  # the batch steps replayed too, not only the refs
    assert not gpu.graph_fallback, gpu.graph_report()
    assert all(s.n_past == c.n_past for s, c in zip(seqs, refs))


def test_mixed_steps_through_the_graphs_give_each_sequence_its_own_logits(engine, monkeypatch):
    """A server's step with prompt chunks among decoding sequences (one pool), routed through decode_step
    (MIXED_GRAPH_MAX_ROWS): every layer and the output on the GPU, a graph per composition (the chunk's attention in
    the tiled kernel, the other rows' in runs of the decode kernel, only each sequence's last row through the
    output; this Q4_K_M model's Q4_K and Q6_K rows on the tensor-core kernels, which a capture takes); each sequence
    gets the logits it gets alone, and the repeated composition is replayed. Split (-ngl 2), the steps run on the
    eager path."""
    import hybrid.engine.engine as ke  # noqa: PLC0415

    monkeypatch.setattr(ke, "MIXED_GRAPH_MAX_ROWS", 64)
    rng = np.random.default_rng(11)
    kv, _ = _scrambled_pool(engine, 64)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.n_vocab, n)] for n in (5, 9, 30)]
    long_prompt = [int(t) for t in rng.integers(3, SHAPE.n_vocab, 117)]
    late = [int(t) for t in rng.integers(3, SHAPE.n_vocab, 6)]
    seqs = [kv.sequence(256) for _ in range(5)]  # A, B, C decode; L takes the long prompt in chunks; M arrives late
    engine.eval_batch(list(zip(prompts, seqs)))
    # (sequence, tokens) per step: L's 20-token chunk between decode rows (two runs of the decode kernel), five
    # times (eager off the graphs, eager in the graph runner, captured, replayed twice; Engine.MIXED_SEEN), then L's
    # last 17 beside all three and M's first 6 at the end
    steps, at = [], 0
    for _ in range(5):
        steps.append([(0, [int(rng.integers(3, SHAPE.n_vocab))]), (1, [int(rng.integers(3, SHAPE.n_vocab))]),
                      (3, long_prompt[at:at + 20]), (2, [int(rng.integers(3, SHAPE.n_vocab))])])
        at += 20
    steps.append([(0, [7]), (3, long_prompt[at:]), (1, [8]), (2, [9]), (4, late)])
    gpu = next(be for be in engine.backends if be.name == "gpu")
    replays = _replays(gpu)
    got = [engine.eval_batch([(t, seqs[i]) for i, t in step]) for step in steps]
    mixed_replays = _replays(gpu) - replays
    refs = [engine.new_cache(256, paged=False) for _ in range(5)]
    for p, c in zip(prompts, refs):
        engine.eval(p, c)
    for step, g in zip(steps, got):
        for (i, t), row in zip(step, g):
            _close(row, engine.eval(t, refs[i]))
    assert all(s.n_past == c.n_past for s, c in zip(seqs, refs))
    if not all(be is gpu for be in (*engine.backends, engine.output_backend)):
        assert mixed_replays == 0  # a split model's mixed steps run on the eager path
    else:  # the first composition: eager twice, captured, then replayed (the last step's is new: eager)
        assert mixed_replays >= 2, gpu.graph_report()
        assert not gpu.graph_fallback, gpu.graph_report()  # every product of these steps captures


def test_the_paged_scheduler_serves_on_the_gpu_and_gives_every_block_back(engine):
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.n_vocab, n)] for n in (9, 40, 70, 12, 25, 100, 3, 50)]
    sched = PagedScheduler(engine, 4, 64, 256, 1024, block_size=32)
    out = _run(sched, prompts, 12)
    assert [len(o) for o in out] == [12] * len(prompts)
    for i in (0, 5):  # the first token: the prompt's greedy one (when clear)
        logits = engine.eval(prompts[i], engine.new_cache(256))
        top2 = np.sort(logits)[-2:]
        if float(top2[1] - top2[0]) > CLEAR_GAP:
            assert out[i][0] == int(np.argmax(logits))
    pool = sched.kv.pool
    assert pool.n_free + sched.radix.n_blocks == pool.n_blocks
    sched.radix.evict(pool.n_blocks)
    assert pool.n_free == pool.n_blocks


def test_the_paged_schedulers_warm_up_captures_every_batch_size_and_gives_its_blocks_back(engine):
    sched = PagedScheduler(engine, 4, 64, 256, 1024, block_size=32)
    gpu = next(be for be in engine.backends if be.name == "gpu")
    assert sched.warm_up() == 4
    assert sched.kv.pool.n_free == sched.kv.pool.n_blocks
    captured = gpu._graphs.stats.captured
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    seqs = [sched.kv.sequence(256) for _ in prompts]
    engine.eval_batch(list(zip(prompts, seqs)))
    for b in (3, 2, 1):  # each batch size's first decode step replays a graph the warm-up captured
        engine.eval_batch([([3], s) for s in seqs[:b]], ids=[True] * b)
    assert gpu._graphs.stats.captured == captured, gpu.graph_report()
    assert not gpu.graph_fallback, gpu.graph_report()


@pytest.mark.parametrize("n_seq", [1, 3, 8])
def test_decode_steps_give_greedy_ids_alone_equal_to_the_logits_argmax(engine, n_seq):
    """eval_batch(ids=...): a decode step replayed on the GPU computes each row's argmax there and, when every row
    wants only that, copies back the ids alone; they equal np.argmax of the logits the same step gives (two sets of
    sequences fed the same tokens through the same graph), and a step mixing both kinds gives each its own."""
    rng = np.random.default_rng(40 + n_seq)
    kv, _ = _scrambled_pool(engine, 96)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.n_vocab, n)] for n in rng.integers(4, 40, n_seq)]
    a, b = ([kv.sequence(256) for _ in prompts] for _ in range(2))
    la = engine.eval_batch(list(zip(prompts, a)))
    ib = engine.eval_batch(list(zip(prompts, b)), ids=[True] * n_seq)  # a prefill (eager): ids on the host
    assert ib == [int(np.argmax(x)) for x in la]
    for step in range(5):
        toks = [int(np.argmax(x)) for x in la]
        la = engine.eval_batch([([t], s) for t, s in zip(toks, a)])
        ib = engine.eval_batch([([t], s) for t, s in zip(toks, b)], ids=[True] * n_seq)
        assert all(isinstance(i, int) for i in ib)
        assert ib == [int(np.argmax(x)) for x in la], step
    gpu = next(be for be in engine.backends if be.name == "gpu")
    assert not gpu.graph_fallback, gpu.graph_report()
    toks = [int(np.argmax(x)) for x in la]
    mixed = [i % 2 == 0 for i in range(n_seq)]
    la = engine.eval_batch([([t], s) for t, s in zip(toks, a)])
    got = engine.eval_batch([([t], s) for t, s in zip(toks, b)], ids=mixed)
    for g, x, m in zip(got, la, mixed):
        if m:
            assert g == int(np.argmax(x))
        else:
            np.testing.assert_array_equal(g, x)
