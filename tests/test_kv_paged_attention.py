"""The paged KV cache (hybrid.kv.paged) read by the CPU attention through block tables: the same outputs as a
contiguous cache (bit for bit where the tiles are the same: every case but a sliding window that starts inside a
block), sequences sharing prompt blocks, the engine's greedy tokens and ragged batches on paged sequences, and the
pool's accounting (all-or-nothing reserve, release, no GPU layers)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.errors import ContextTooLarge, HybridError
from hybrid.kv.blocks import OutOfBlocks
from hybrid.kv.paged import PagedKV
from hybrid.tools.synth.model import make_model
from kernels_cpu.attention import attention, attention_seqs
from kernels_cpu.kv_cache import alloc_kv_layer, kv_read, kv_store

N_HEAD, N_HEAD_KV, HD = 8, 2, 64


def _paged_view(pool_layer, table, bs):
    return replace(pool_layer, table=np.asarray(table, dtype=np.int32), block_size=bs)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("bs, n_swa", [(32, 0), (64, 0), (64, 40)])
def test_paged_attention_equals_contiguous(kv_type, bs, n_swa):
    rng = np.random.default_rng(bs + n_swa)
    n_kv, n_tok = 150, 5  # blocks out of order in the pool, the last one partly used
    k = rng.standard_normal((n_kv, N_HEAD_KV, HD)).astype(np.float32)
    v = rng.standard_normal((n_kv, N_HEAD_KV, HD)).astype(np.float32)
    q = rng.standard_normal((n_tok, N_HEAD, HD)).astype(np.float32)
    pos = np.arange(n_kv - n_tok, n_kv, dtype=np.int32)
    flat = alloc_kv_layer(n_kv, N_HEAD_KV, HD, HD, kv_type, kv_type)
    n_blocks = -(-n_kv // bs)
    pool = alloc_kv_layer((n_blocks + 3) * bs, N_HEAD_KV, HD, HD, kv_type, kv_type)
    table = rng.permutation(n_blocks + 3)[:n_blocks]
    paged = _paged_view(pool, table, bs)
    for layer in (flat, paged):
        kv_store(layer, np.arange(n_kv), k, v)
    kf, vf = kv_read(flat, 0, n_kv)
    kp, vp = kv_read(paged, 0, n_kv)
    assert np.array_equal(kf, kp) and np.array_equal(vf, vp)
    a = attention(q, flat, pos, 0.125, n_swa)
    b = attention(q, paged, pos, 0.125, n_swa)
    if n_swa and (n_kv - n_tok - n_swa + 1) % bs:  # the window starts inside a block: tiles split there
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert np.array_equal(a, b)


def test_paged_sequences_share_prefix_blocks_in_one_batch():
    """Two sequences whose first two blocks are one prompt's (stored once, shared), each with its own tail, attend in
    one ragged call as each would alone in a contiguous cache."""
    rng = np.random.default_rng(3)
    bs, n_pre = 32, 64
    pool = alloc_kv_layer(8 * bs, N_HEAD_KV, HD, HD, "q8_0", "q8_0")
    pre_k, pre_v = (rng.standard_normal((n_pre, N_HEAD_KV, HD)).astype(np.float32) for _ in range(2))
    a_view = _paged_view(pool, [5, 2, 7, -1], bs)
    kv_store(a_view, np.arange(n_pre), pre_k, pre_v)
    b_view = _paged_view(pool, [5, 2, 0, -1], bs)  # shares blocks 5, 2
    tails = {}
    for name in ("a", "b"):
        tails[name] = [rng.standard_normal((10, N_HEAD_KV, HD)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((20, N_HEAD, HD)).astype(np.float32)
    pos = np.concatenate([np.arange(n_pre, n_pre + 10)] * 2).astype(np.int32)
    k = np.concatenate([tails["a"][0], tails["b"][0]])
    v = np.concatenate([tails["a"][1], tails["b"][1]])
    out = attention_seqs(q, k, v, [a_view, b_view], [(0, 10), (10, 20)], pos, 0.1)
    for i, name in enumerate(("a", "b")):
        flat = alloc_kv_layer(n_pre + 10, N_HEAD_KV, HD, HD, "q8_0", "q8_0")
        kv_store(flat, np.arange(n_pre), pre_k, pre_v)
        kv_store(flat, np.arange(n_pre, n_pre + 10), *tails[name])
        ref = attention(q[10 * i : 10 * i + 10], flat, pos[:10], 0.1)
        assert np.array_equal(out[10 * i : 10 * i + 10], ref)


def test_paged_layer_checks_its_blocks():
    pool = alloc_kv_layer(4 * 32, N_HEAD_KV, HD, HD)
    view = _paged_view(pool, [1, -1], 32)
    x = np.zeros((1, N_HEAD_KV, HD), np.float32)
    kv_store(view, np.array([31]), x, x)
    with pytest.raises(ValueError, match="allocated blocks"):
        kv_store(view, np.array([32]), x, x)  # block 1 of the table is not allocated
    with pytest.raises(ValueError, match="allocated blocks"):
        kv_store(view, np.array([64]), x, x)  # past the table
    with pytest.raises(ValueError, match="not all in allocated blocks"):
        attention(np.zeros((1, N_HEAD, HD), np.float32), view, np.array([40], np.int32), 0.1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("paged") / "llama.gguf"
    make_model(path, "llama", "tiny", "Q8_0", seed=5, n_layer=2)
    return Engine.load(path, EngineParams(n_ctx=512))


def _greedy(engine, cache, prompt, n):
    ids, logits = [], engine.eval(prompt, cache)
    for _ in range(n):
        ids.append(int(np.argmax(logits)))
        logits = engine.eval([ids[-1]], cache)
    return ids, logits


def test_engine_on_a_paged_sequence_equals_a_contiguous_cache(engine):
    kv = PagedKV(engine.config, engine.backends, n_blocks=16, block_size=64)
    prompt = list(range(5, 90))
    ref_ids, ref_logits = _greedy(engine, engine.new_cache(paged=False), prompt, 12)
    seq = kv.sequence(512)
    ids, logits = _greedy(engine, seq, prompt, 12)
    assert ids == ref_ids and np.array_equal(logits, ref_logits)
    assert len(seq.blocks) == 2 and kv.pool.n_free == 14  # 97 positions: two blocks of 64
    seq.release()
    assert kv.pool.n_free == 16 and (seq.table == -1).all() and seq.n_past == 0


def test_engine_shares_a_prompt_prefix_and_batches_paged_sequences(engine):
    """b adopts the blocks of a's first 128 prompt tokens (not evaluated again); a step over both in one ragged
    batch gives each the logits it has alone in a contiguous cache."""
    kv = PagedKV(engine.config, engine.backends, n_blocks=8, block_size=64)
    prefix, tail_a, tail_b = list(range(3, 131)), [7, 8, 9], [20, 21]
    a = kv.sequence(256)
    engine.eval(prefix, a)
    b = kv.sequence(256)
    b.adopt(a.blocks[:2])
    assert b.n_past == 128 and kv.pool.ref[a.blocks[0]] == 2
    got = engine.eval_batch([(tail_a, a), (tail_b, b)])
    for tail, logits in ((tail_a, got[0]), (tail_b, got[1])):
        ref = engine.new_cache(paged=False)
        engine.eval(prefix, ref)
        assert np.array_equal(logits, engine.eval(tail, ref))
    assert len(a.blocks) == 3 and len(b.blocks) == 3 and kv.pool.n_free == 8 - 4
    a.release()
    assert kv.pool.ref[b.blocks[0]] == 1 and kv.pool.n_free == 8 - 3
    b.release()
    assert kv.pool.n_free == 8


def test_reserve_is_all_or_nothing_and_backends_without_tables_are_refused(engine):
    kv = PagedKV(engine.config, engine.backends, n_blocks=2, block_size=64)
    seq = kv.sequence(512)
    with pytest.raises(OutOfBlocks):
        engine.eval(list(range(3, 200)), seq)  # three blocks wanted, two in the pool
    assert kv.pool.n_free == 2 and seq.blocks == [] and seq.n_past == 0

    class NoPaging:
        paged_kv = False

    with pytest.raises(HybridError, match="read block tables"):
        PagedKV(engine.config, [NoPaging()] * engine.config.n_layer, n_blocks=2)


def test_new_cache_is_a_paged_sequence_of_its_own_pool(engine):
    """The cache of run, chat and perplexity (Engine.new_cache): a paged sequence whose own pool holds
    ceil(n_ctx / 64) blocks. Evaluating, rolling back (chat keeps the common prefix, a speculative check drops its
    rejected tail), going on and clearing give a contiguous cache's logits bit for bit; kv_paged=False, or
    paged=False, gives the contiguous cache."""
    cache, ref = engine.new_cache(200), engine.new_cache(200, paged=False)
    assert cache.paged and not ref.paged and cache.n_ctx == ref.n_ctx == 200
    assert cache.pool_of.pool.n_blocks == 4 and cache.pool_of.pool.n_free == 4
    prompt = list(range(5, 80))
    assert np.array_equal(engine.eval(prompt, cache), engine.eval(prompt, ref))
    assert cache.pool_of.pool.n_free == 2  # 75 positions: two blocks of 64
    cache.n_past = ref.n_past = 40  # the rollback
    for step in ([7, 8, 9], [11], [12]):
        assert np.array_equal(engine.eval(step, cache), engine.eval(step, ref)), step
    cache.clear()
    ref.clear()
    assert cache.pool_of.pool.n_free == 4 and cache.n_past == 0
    assert np.array_equal(engine.eval(prompt[:9], cache), engine.eval(prompt[:9], ref))
    with pytest.raises(ContextTooLarge):
        engine.eval(list(range(3, 300)), engine.new_cache(200))
    params = engine.params
    try:
        engine.params = replace(params, kv_paged=False)
        assert not engine.new_cache(64).paged and engine.new_cache(64, paged=True).paged
    finally:
        engine.params = params
