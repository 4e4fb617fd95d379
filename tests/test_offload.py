"""Op offload (hybrid/backends/op_offload.py): big prefill batches of CPU-resident layers run on the GPU on streamed weights.

CPU (CI): the decision, row pieces, the stream order, the VRAM sizes, and OpOffload's bookkeeping with a fake
stream and a fake GPU (pieces in order, skipped, or uploaded when not streamed). GPU (`-m gpu`): the streamed
matmul equals the GPU-resident one on the same weights, and a synthetic F16 model prefilled with op offload on
and off (-ngl 0 and 1, several micro-batches, a second eval over the cache) gives the same next-token
distributions (KL < 1e-3 at every position).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from hybrid.backends.cpu import CpuBackend
from hybrid.system.devices import probe_gpus
from hybrid.backends.op_offload import (MATRIX_ORDER, OP_OFFLOAD_MIN_BATCH, DecodeChoice, OpOffload, stream_order,
                                        wants_offload)
from hybrid.plan.budget import STREAM_PIECE_MAX_BYTES, STREAM_SLOTS, op_offload_bytes, row_pieces, slot_bytes
from hybrid.plan.placement import GPU_OVERHEAD_BYTES
from hybrid.tools.synth.model import ModelShape, make_model
from hybrid.model.weights import Weight

SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024, n_swa=32)
KL_MAX_F16 = 1e-3


def has_gpu() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return bool(probe_gpus()[0])


gpu_only = pytest.mark.skipif(not has_gpu(), reason="needs CuPy and a CUDA device")


# ---------------------------------------------------------------- pure logic (CI)

def test_offload_threshold_is_llamas():
    assert OP_OFFLOAD_MIN_BATCH == 32
    assert not wants_offload(31) and wants_offload(32) and wants_offload(512)
    assert not wants_offload(1) and wants_offload(8, min_batch=8)


@pytest.mark.parametrize("n_rows,row_bytes,max_bytes", [(10, 100, 1000), (10, 100, 250), (7, 3360, 10_000),
                                                        (3, 5000, 100), (1, 1, 1 << 20)])
def test_row_pieces_cover_the_rows(n_rows, row_bytes, max_bytes):
    pieces = row_pieces(n_rows, row_bytes, max_bytes)
    assert pieces[0][0] == 0 and pieces[-1][1] == n_rows
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all(r1 > r0 and ((r1 - r0) * row_bytes <= max_bytes or r1 - r0 == 1) for r0, r1 in pieces)
    assert len(pieces) == -(-n_rows // max(1, max_bytes // row_bytes))


def _w(name: str, *shape: int, dtype=np.uint8) -> Weight:
    raw = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape)
    return Weight(name, "F32" if raw.ndim == 1 else "Q8_0", shape, raw)


def test_stream_order_follows_the_blocks():
    lw = {"ffn_down": _w("d", 4, 34), "attn_norm": _w("n", 8, dtype=np.float32), "attn_v": _w("v", 2, 34),
          "ffn_up_exps": _w("e", 2, 4, 34), "attn_q": _w("q", 4, 34), "extra": _w("x", 2, 34),
          "attn_k": _w("k", 2, 34), "attn_q.bias": _w("b", 4, dtype=np.float32)}
    assert stream_order(lw) == ["attn_q", "attn_k", "attn_v", "ffn_down", "extra"]
    assert MATRIX_ORDER.index("attn_output") < MATRIX_ORDER.index("ffn_gate") < MATRIX_ORDER.index("ffn_down")


def test_sizes_of_an_8b_model():
    from test_placement import LLAMA_8B, make_config, make_tensors

    cfg, ts = make_config(**LLAMA_8B), make_tensors(**LLAMA_8B)
    slot = slot_bytes(ts)
    layer_max = max(t.nbytes for n, t in ts.items() if n.startswith("blk.") and len(t.shape) == 2)
    assert layer_max <= slot <= STREAM_PIECE_MAX_BYTES  # the output layer (~430 MB) streams in pieces
    assert slot_bytes({k: t for k, t in ts.items() if k.startswith("blk.")}) == layer_max
    need = op_offload_bytes(cfg, ts, 4096, 512, n_gpu_layers=16)  # the plan counts the compute buffers
    kv_one_layer = 4096 * 8 * 128 * 2 * 2
    assert STREAM_SLOTS * slot + kv_one_layer <= need < STREAM_SLOTS * slot + kv_one_layer + (2 << 20)
    assert op_offload_bytes(cfg, ts, 4096, 512, n_gpu_layers=2) == need
    output_only = op_offload_bytes(cfg, ts, 4096, 512, n_gpu_layers=1)  # the plan lacks a layer's buffers
    alone = op_offload_bytes(cfg, ts, 4096, 512, n_gpu_layers=0)
    assert need < output_only < alone
    assert alone > need + GPU_OVERHEAD_BYTES + 512 * 128256 * 4  # + the overhead and the logits at least


class FakeStream:
    """WeightStream's protocol on the host: slots are the sources themselves, every call logged."""

    slot_bytes = 1 << 20

    def __init__(self):
        self.log: list = []
        self.sources: list = []
        self.next = 0

    def register(self, sources):
        return "fake: not registered"

    def start(self, sources):
        self.sources, self.next = list(sources), 0
        self.log.append(("start", len(self.sources)))

    def take(self):
        i = self.next
        self.next += 1
        self.log.append(("take", i))
        return i

    def view(self, slot, nbytes):
        return self.sources[slot][:nbytes]

    def release(self, slot):
        self.log.append(("release", slot))

    def stop(self):
        self.log.append(("stop",))

    def close(self):
        self.log.append(("close",))


class FakeGpu:
    def __init__(self):
        self.uploads: list[str] = []

    def upload(self, w: Weight) -> Weight:
        self.uploads.append(w.name)
        return Weight(w.name, w.type_name, w.shape, np.array(w.raw))


def test_op_offload_streams_pieces_in_order_skips_and_falls_back():
    gpu, stream, cpu = FakeGpu(), FakeStream(), CpuBackend()
    off = OpOffload(gpu, cpu, stream, max_piece=2 * 34)  # 2 rows a piece
    lw0 = {"attn_norm": _w("blk.0.attn_norm", 8, dtype=np.float32), "attn_q": _w("blk.0.attn_q", 4, 34),
           "attn_k": _w("blk.0.attn_k", 2, 34)}
    lw1 = {"attn_q": _w("blk.1.attn_q", 2, 34)}
    gpu_be = object()
    with off.batch([cpu, gpu_be], [lw0, lw1]) as (backends, layers):
        assert backends[0] is off.backend and backends[1] is gpu_be and layers[1] is lw1
        assert gpu.uploads == ["blk.0.attn_norm"]  # 1-D weights go up once
        assert [s.nbytes for s in stream.sources] == [68, 68, 68]  # attn_q in 2 pieces, then attn_k
        q = lw0["attn_q"]
        with off.piece(q, 0, 2) as dev:
            assert np.array_equal(dev, q.raw[0:2])
        with off.piece(lw0["attn_k"], 0, 2) as dev:  # attn_q's 2nd piece was streamed but not asked for: skipped
            assert np.array_equal(dev, lw0["attn_k"].raw)
        with off.piece(q, 2, 4) as dev:  # no longer streaming: uploaded now
            assert np.array_equal(dev, q.raw[2:4])
    assert stream.log == [("start", 3), ("take", 0), ("release", 0), ("take", 1), ("release", 1), ("take", 2),
                          ("release", 2), ("stop",)]
    assert gpu.uploads == ["blk.0.attn_norm", "blk.0.attn_q"] and off.batches == 1 and off.streamed_bytes == 204
    with off.batch([cpu], [lw0]):  # the 1-D weights are not uploaded again
        pass
    assert gpu.uploads == ["blk.0.attn_norm", "blk.0.attn_q"]
    off.close()
    assert stream.log[-1] == ("close",)


def test_batch_within_streams_only_those_layers():
    gpu, stream, cpu = FakeGpu(), FakeStream(), CpuBackend()
    off = OpOffload(gpu, cpu, stream)
    lws = [{"attn_q": _w(f"blk.{i}.attn_q", 2, 34)} for i in range(3)]
    with off.batch([cpu, cpu, cpu], lws, within=range(1, 3)) as (backends, layers):
        assert backends[0] is cpu and layers[0] is lws[0]
        assert backends[1] is backends[2] is off.backend
        assert [s.nbytes for s in stream.sources] == [68, 68]


def test_decode_choice_tries_both_then_keeps_the_faster():
    dc = DecodeChoice(lo=2, hi=32, trials=2)
    assert not dc.streamed(1) and dc.streamed(32) and dc.streamed(100)  # not its call: below lo, from hi on
    cost = {False: 0.010, True: 0.004}  # the stream faster at 8 rows
    ways = []
    for _ in range(4):
        way = dc.streamed(8)
        ways.append(way)
        dc.record(8, way, cost[way])
    assert ways == [False, True, False, True]  # alternating, the CPU first
    assert dc.decided == {8: True} and all(dc.streamed(8) for _ in range(3))
    dc.record(8, False, 0.001)  # a decided size records nothing more
    assert dc.decided == {8: True} and len(dc.times[8, False]) == 2
    assert dc.streamed(9) and dc.streamed(31)  # the stream's cost does not grow with the rows: larger sizes follow
    assert dc.known(4) is None  # smaller sizes still try
    for way in (False, True, False, True):
        dc.record(4, way, {False: 0.003, True: 0.004}[way])
    assert dc.decided[4] is False and dc.known(3) is False and dc.known(2) is False and dc.known(6) is None
    assert dc.describe() == "CPU at 4 rows; streamed at 8 rows"


def test_decode_choice_takes_the_best_time_not_the_first():
    dc = DecodeChoice(trials=3)
    for way, t in [(False, 0.010), (True, 2.0), (False, 0.011), (True, 0.004), (False, 0.012), (True, 0.005)]:
        assert dc.streamed(4) == way
        dc.record(4, way, t)  # the stream's first batch page-locks the weights: slow once
    assert dc.decided == {4: True}


def test_op_offload_releases_the_slot_on_error():
    stream = FakeStream()
    off = OpOffload(FakeGpu(), CpuBackend(), stream)
    w = _w("blk.0.attn_q", 4, 34)
    with pytest.raises(RuntimeError):
        with off.batch([CpuBackend()], [{"attn_q": w}]):
            with off.piece(w, 0, 4):
                raise RuntimeError("kernel failed")
    assert stream.log[-2:] == [("release", 0), ("stop",)]


def test_cli_flag_turns_it_off():
    from hybrid.cli.options import engine_params

    assert engine_params({"no_op_offload": False}).op_offload is True
    assert engine_params({"no_op_offload": True}).op_offload is False
    assert engine_params({}).op_offload is False  # a library caller (EngineParams()) stays on the CPU


@pytest.mark.skipif(has_gpu(), reason="the GPU tests below cover a machine with a GPU")
def test_no_gpu_means_no_offload(tmp_path):
    pytest.importorskip("numba")
    from hybrid.engine import Engine, EngineParams

    path = tmp_path / "llama.gguf"
    make_model(path, "llama", SHAPE, "F16", seed=3, threads=1)
    tokens = np.arange(40) % 1000
    a = Engine.load(path, EngineParams(n_ctx=64, op_offload=True))
    b = Engine.load(path, EngineParams(n_ctx=64))
    try:
        assert a.op_offload is None
        assert np.array_equal(a.eval(tokens, a.new_cache()), b.eval(tokens, b.new_cache()))
    finally:
        a.close()
        b.close()


class FakeStreamed:
    """Stands in for OffloadBackend: the CPU's own ops, counting the hidden states handed to it."""

    name = "fake-offload"

    def __init__(self, cpu: CpuBackend) -> None:
        self.cpu, self.runs = cpu, 0

    def from_host(self, x):
        self.runs += 1
        return x

    def __getattr__(self, name):
        return getattr(self.cpu, name)


class FakeOff:
    """An OpOffload whose 'streamed' layers are FakeStreamed (the CPU's kernels): the engine's choice, not a GPU."""

    min_batch = OP_OFFLOAD_MIN_BATCH

    def __init__(self, cpu: CpuBackend, decode: DecodeChoice) -> None:
        self.backend, self.decode, self.batches = FakeStreamed(cpu), decode, 0

    def wants(self, n: int) -> bool:
        return wants_offload(n)

    @contextmanager
    def batch(self, backends, layers, within=None):
        self.batches += 1
        yield [self.backend if isinstance(b, CpuBackend) and (within is None or i in within) else b
               for i, b in enumerate(backends)], layers

    def close(self) -> None:
        pass


class StreamFaster(DecodeChoice):
    """A DecodeChoice that is told the stream took half the CPU's time (a GPU machine's outcome, without the noise)."""

    def record(self, n: int, streamed: bool, seconds: float) -> None:
        super().record(n, streamed, 1.0 if streamed else 2.0)


def test_engine_runs_small_batches_the_way_decode_choice_says(tmp_path):
    """eval_batch's steps below the threshold (a 21-row prompt step, then 4-row decode steps) go through op offload's
    batch when DecodeChoice says so, one trial each way first; the 'streamed' layers here are the CPU's own kernels,
    so the logits are exactly those of the CPU run, and one row never asks."""
    pytest.importorskip("numba")
    from hybrid.engine import Engine, EngineParams

    path = tmp_path / "llama.gguf"
    make_model(path, "llama", SHAPE, "Q4_K_M", seed=3, threads=1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, SHAPE.n_vocab, n) for n in (5, 1, 12, 3)]
    eng = Engine.load(path, EngineParams(n_ctx=64))
    try:
        out = {}
        for mode in ("cpu", "choice"):
            eng.op_offload = None if mode == "cpu" else FakeOff(eng.cpu, StreamFaster(trials=1))
            caches = [eng.new_cache(64) for _ in prompts]
            steps = [eng.eval_batch(list(zip(prompts, caches)))]
            for _ in range(4):
                steps.append(eng.eval_batch([([int(np.argmax(lg))], c) for lg, c in zip(steps[-1], caches)]))
            alone = eng.new_cache(64)
            eng.eval(prompts[0][:1], alone)
            eng.eval([7], alone)  # one row: never the choice's
            out[mode] = np.stack([np.stack(s) for s in steps])
        off = eng.op_offload
        assert off.decode.decided == {4: True}  # 4 rows: the CPU's trial (first), the stream's, then the stream
        assert len(off.decode.times[21, False]) == 1 and off.decode.known(21)  # the prompt step: a CPU trial, then
        # settled by the 4 rows' decision (the stream's cost does not grow with the rows)
        assert off.batches == 3 and off.backend.runs == 3  # decode steps 2-4: one run of the layers each
        assert set(off.decode.times) == {(21, False), (4, False), (4, True)}
        np.testing.assert_array_equal(out["cpu"], out["choice"])
    finally:
        eng.op_offload = None
        eng.close()


# ---------------------------------------------------------------- on the GPU

def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_pos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per position max(KL(a||b), KL(b||a)) of the log-probs a, b (n, n_vocab)."""
    pa, pb = np.exp(a), np.exp(b)
    return np.maximum((pa * (a - b)).sum(-1), (pb * (b - a)).sum(-1))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload")
    cache: dict = {}

    def get(arch: str, mix: str = "F16"):
        if (arch, mix) not in cache:
            cache[arch, mix] = d / f"{arch}-{mix}.gguf"
            make_model(cache[arch, mix], arch, SHAPE, mix, seed=5, threads=4)
        return cache[arch, mix]

    return get


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mix", ["F16", "Q4_K_M"])
@pytest.mark.parametrize("max_piece", [None, 40_000])  # one piece per matrix; several row pieces per matrix
@pytest.mark.parametrize("direct", [True, False])  # DMA from the page-locked map, or staged through pinned chunks
def test_streamed_matmul_equals_resident(models, mix, max_piece, direct):
    import cupy

    from hybrid.backends.gpu import GpuBackend
    from hybrid.engine import Engine, EngineParams
    from kernels_gpu.transfer import WeightStream

    eng = Engine.load(models("llama", mix), EngineParams(n_ctx=64, repack=False))  # the file's layout, as streamed
    gpu, cpu = GpuBackend(), CpuBackend()
    off = OpOffload(gpu, cpu, WeightStream(slot_bytes(eng.gguf.tensors)), max_piece=max_piece)
    if not direct:
        off.register_note = "not registered (test)"  # as if registration had been refused
    try:
        lw = eng.weights.layers[1]
        rng = np.random.default_rng(0)
        names = stream_order(lw)
        with off.batch([cpu], [lw]) as (_, [lwo]):
            for name in names[::-1] if max_piece else names:  # reversed: skips, then uploads outside the stream
                w = lwo[name]
                x = cupy.asarray(rng.standard_normal((64, w.shape[1])).astype(np.float32))
                got = off.backend.matmul(w, x).get()
                ref = gpu.matmul(gpu.upload(w), x).get()
                if max_piece is None:
                    assert np.array_equal(got, ref), name
                else:
                    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=name)
        assert off.batches == 1
        assert off.register_note == ("" if direct else "not registered (test)"), off.register_note
        assert (off.stream.direct_bytes > 0) == direct
    finally:
        off.close()
        eng.close()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe"])
@pytest.mark.parametrize("ngl", ["0", "1"])
def test_prefill_with_op_offload_matches_without(models, arch, ngl):
    """96 tokens in micro-batches of 32 (each offloaded, the later ones attending to the host cache), then 40
    more over that cache: the same log-probs at every position as the CPU layers' own prefill (F16)."""
    from hybrid.engine import Engine, EngineParams

    path = models(arch)
    seq = np.random.default_rng(7).integers(1, SHAPE.n_vocab, 136)
    out = {}
    for on in (False, True):
        eng = Engine.load(path, EngineParams(n_ctx=192, n_batch=96, n_ubatch=32, n_gpu_layers=ngl, op_offload=on))
        try:
            if on:
                assert eng.op_offload is not None
                eng.op_offload.max_piece = 64 * 1024  # several pieces for the larger matrices
            cache = eng.new_cache()
            first = eng.eval(seq[:96], cache, logits_from=0)
            rest = eng.eval(seq[96:], cache, logits_from=0)
            out[on] = log_softmax(np.concatenate([first, rest]))
            if on:
                assert eng.op_offload.batches >= 4  # 3 + 1 layer batches (+ the output layer's at -ngl 0)
        finally:
            eng.close()
    kl = kl_pos(out[False], out[True])
    assert np.isfinite(out[True]).all()
    if arch == "qwen3moe":  # routing on the host may flip at a near tie of the router: most positions agree
        assert np.median(kl) < KL_MAX_F16, kl.max()
    else:
        assert kl.max() < KL_MAX_F16, (kl.max(), int(kl.argmax()))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_streamed_decode_batch_matches_the_cpu(models, arch):
    """A split model's decode steps of 4 paged sequences (one pool, the server's layout), the CPU layers run on the
    CPU and streamed to the GPU (DecodeChoice forced each way): the same next-token distributions, step by step."""
    from hybrid.engine import Engine, EngineParams
    from hybrid.kv.paged import PagedKV

    path = models(arch)
    eng = Engine.load(path, EngineParams(n_ctx=256, n_gpu_layers="3", op_offload=True))
    try:
        assert eng.op_offload is not None and eng.replays_graphs
        rng = np.random.default_rng(11)
        prompts = [rng.integers(1, SHAPE.n_vocab, n) for n in (5, 17, 9, 30)]
        out = {}
        for streamed in (False, True):
            eng.op_offload.decode.decided = {n: streamed for n in range(2, 32)}
            pool = PagedKV(eng.config, eng.backends, 32, 16)
            seqs = [pool.sequence(64) for _ in prompts]
            for p, c in zip(prompts, seqs):
                eng.eval(p, c)
            toks = [int(p[-1]) for p in prompts]
            steps = []
            for _ in range(6):
                logits = eng.eval_batch([([t], c) for t, c in zip(toks, seqs)])
                steps.append(log_softmax(np.stack(logits)))
                toks = [int(l.argmax()) for l in logits]
            out[streamed] = np.stack(steps)
        batches = eng.op_offload.batches
        assert batches >= 6, batches  # every streamed step streamed the CPU layers
        kl = kl_pos(out[False].reshape(-1, SHAPE.n_vocab), out[True].reshape(-1, SHAPE.n_vocab))
        assert np.isfinite(out[True]).all()
        assert (np.median(kl) if arch == "qwen3moe" else kl.max()) < KL_MAX_F16, kl.max()
    finally:
        eng.close()


@pytest.mark.gpu
@gpu_only
def test_op_offload_is_counted_in_the_budget(models):
    from hybrid.engine import Engine, EngineParams
    from hybrid.errors import PlacementError

    path = models("llama")
    with pytest.raises(PlacementError, match="no-op-offload"):
        Engine.load(path, EngineParams(n_ctx=64, op_offload=True, vram_budget=64 * 2**20))
    eng = Engine.load(path, EngineParams(n_ctx=64, n_gpu_layers="2", op_offload=True))
    try:
        assert eng.placement.overhead_bytes > GPU_OVERHEAD_BYTES + STREAM_SLOTS * eng.op_offload.stream.slot_bytes
    finally:
        eng.close()
