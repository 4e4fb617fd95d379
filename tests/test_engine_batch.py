"""Engine.eval_batch: a ragged batch of sequences (different positions and lengths, each with its own KV cache)
gives each sequence the logits it gets alone. On the CPU exactly (below 64 rows a row's integer dots and its
attention do not depend on the other rows; the fused FFN runs per row); on the GPU (eager ops for the batch, CUDA
graphs for a sequence alone) within KL 1e-3 on F16 weights. Synthetic models (hybrid.tools.synth): a dense llama,
gemma3 (sliding-window layers) and qwen3moe (experts shared by the batch's rows)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.engine.engine import _ubatches
from hybrid.tools.synth.model import ModelShape, make_model

SHAPE = ModelShape(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024, n_swa=8)
LENGTHS = (5, 1, 12, 3)  # prompt tokens of each sequence


def test_ubatches_cut_the_stacked_rows():
    assert _ubatches([5, 1, 12, 3], 8) == [[(0, 0, 5), (1, 0, 1), (2, 0, 2)], [(2, 2, 10)], [(2, 10, 12), (3, 0, 3)]]
    assert _ubatches([1, 1, 1], 512) == [[(0, 0, 1), (1, 0, 1), (2, 0, 1)]]


def test_mixed_steps_take_the_decode_graphs_only_where_every_product_captures():
    """Engine._mixed_graph: a batch with a prompt chunk, at most MIXED_GRAPH_MAX_ROWS rows of a dense model whose
    layers and output are on one backend that replays decode steps, and whose matrices' types all have a kernel a
    capture takes for that many rows (GpuBackend.captures_products: up to 8 rows any type; 9-64 rows, Q4_K and
    Q6_K's tensor-core kernels, not cuBLAS); a composition from its second step on (the first runs eagerly and
    leaves no graph entry), the last MIXED_SEEN remembered."""
    from types import SimpleNamespace

    from hybrid.backends.gpu import GpuBackend
    from hybrid.engine.engine import MIXED_GRAPH_MAX_ROWS, MIXED_SEEN

    class Replays:  # a backend that replays decode steps (the check reads only that it has decode_step)
        captures_products = staticmethod(GpuBackend.captures_products)

        def decode_step(self):
            raise AssertionError("not called")

    be = Replays()

    def engine(types=("Q4_K", "Q6_K"), out="Q6_K", n_expert=0, backends=None):
        return SimpleNamespace(config=SimpleNamespace(n_expert=n_expert), output_backend=be,
                               backends=[be, be] if backends is None else backends, _matrix_types=frozenset(types),
                               weights=SimpleNamespace(output=SimpleNamespace(type_name=out)), mixed_seen={})

    def mixed(e, lengths):  # a composition's second step: the first runs eagerly
        first = Engine._mixed_graph(e, lengths)
        again = Engine._mixed_graph(e, lengths)
        assert not first or not again  # never a graph at first sight
        return again

    e = engine()
    assert not Engine._mixed_graph(e, [1, 1, 20, 1]) and Engine._mixed_graph(e, [1, 1, 20, 1])
    assert Engine._mixed_graph(e, [1, 1, 20, 1])  # and from then on
    others = [[a, b] for a in range(1, 20) for b in range(2, 40)][:MIXED_SEEN]
    for lengths in others:  # MIXED_SEEN other compositions push it out
        Engine._mixed_graph(e, lengths)
    assert len(e.mixed_seen) == MIXED_SEEN and not Engine._mixed_graph(e, [1, 1, 20, 1])
    assert mixed(engine(), [1, 1, 20, 1]) and mixed(engine(), [1] * 4 + [MIXED_GRAPH_MAX_ROWS - 4])
    assert not mixed(engine(), [1] * 4 + [MIXED_GRAPH_MAX_ROWS - 3])  # past the rows a graph takes
    assert not mixed(engine(), [1] * 12)  # a decode batch past GRAPH_MAX_TOKENS stays eager
    assert not mixed(engine(types=("Q4_K", "Q5_K")), [1, 1, 20])  # Q5_K's 23 rows: cuBLAS
    assert mixed(engine(types=("Q4_K", "Q5_K")), [1, 1, 4])  # 6 rows: the matvec kernels
    assert not mixed(engine(out="F16"), [1] * 9 + [4])  # the output's 10 rows of F16: cuBLAS
    assert mixed(engine(out="F16"), [1] * 7 + [4])  # its 8 rows: the matvec kernel
    assert not mixed(engine(n_expert=8), [1, 20])  # MoE routing leaves the graph
    assert not mixed(engine(backends=[be, object()]), [1, 20])  # a layer elsewhere (a split model)


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3moe"])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / f"{request.param}.gguf"
    make_model(path, request.param, SHAPE, "Q4_K_M", seed=3, threads=2)
    return path


def _solo_and_batched(engine: Engine, n_steps: int = 4):
    """Each prompt alone (then n_steps greedy decode steps), and all of them as one ragged batch per step;
    -> (solo logits, batched logits), each [step][sequence] (n_vocab,)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, SHAPE.n_vocab, n) for n in LENGTHS]
    solo = []
    for p in prompts:
        cache = engine.new_cache(64)
        rows = [engine.eval(p, cache)]
        for _ in range(n_steps):
            rows.append(engine.eval([int(np.argmax(rows[-1]))], cache))
        solo.append(rows)
    caches = [engine.new_cache(64) for _ in prompts]
    steps = [engine.eval_batch(list(zip(prompts, caches)))]
    for _ in range(n_steps):
        steps.append(engine.eval_batch([([int(np.argmax(lg))], c) for lg, c in zip(steps[-1], caches)]))
    return [list(r) for r in zip(*solo)], steps


def test_cpu_ragged_batch_equals_each_sequence_alone(model_path):
    engine = Engine.load(model_path, EngineParams(n_ctx=256))
    try:
        engine.params = replace(engine.params, n_ubatch=8)  # the prefill step spans three micro-batches
        solo, batched = _solo_and_batched(engine)
        for s, b in zip(solo, batched):
            for x, y in zip(s, b):
                np.testing.assert_array_equal(x, y)
    finally:
        engine.close()


def test_eval_batch_refuses_a_cache_twice_and_skips_unwanted_logits(model_path):
    engine = Engine.load(model_path, EngineParams(n_ctx=256))
    try:
        a, b = engine.new_cache(32), engine.new_cache(32)
        with pytest.raises(Exception, match="twice"):
            engine.eval_batch([([1, 2], a), ([3], a)])
        calls = []
        out = engine.eval_batch([([1, 2], a), ([3], b)], want=[False, True], beside=lambda: calls.append(1))
        assert out[0] is None and out[1].shape == (SHAPE.n_vocab,)
        assert (a.n_past, b.n_past) == (2, 1)
        assert calls == [1]  # the host work beside the step ran once (before it, on the CPU)
        engine.eval_batch([([4], a)], beside=lambda: calls.append(2))  # one sequence: Engine.eval's path
        assert calls == [1, 2]
        a, b, c, d = (engine.new_cache(32) for _ in range(4))  # ids: the argmax of the logits the same step gives
        want = engine.eval_batch([([1, 2, 3], c), ([3], d)])
        got = engine.eval_batch([([1, 2, 3], a), ([3], b)], ids=[True, True])
        assert got == [int(np.argmax(w)) for w in want] and all(isinstance(g, int) for g in got)
        got = engine.eval_batch([([5], a), ([6], b)], ids=[False, True])
        want = engine.eval_batch([([5], c), ([6], d)])
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == int(np.argmax(want[1]))
    finally:
        engine.close()


def _kl(a: np.ndarray, b: np.ndarray) -> float:
    la = a.astype(np.float64) - np.logaddexp.reduce(a.astype(np.float64))
    lb = b.astype(np.float64) - np.logaddexp.reduce(b.astype(np.float64))
    return float(max((np.exp(la) * (la - lb)).sum(), (np.exp(lb) * (lb - la)).sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("ngl", ["all", "2"])
def test_gpu_ragged_batch_matches_each_sequence_alone(tmp_path, ngl):
    pytest.importorskip("cupy")
    path = tmp_path / "llama-f16.gguf"
    make_model(path, "llama", SHAPE, "F16", seed=3, threads=2)
    engine = Engine.load(path, EngineParams(n_ctx=256, n_gpu_layers=ngl))
    try:
        solo, batched = _solo_and_batched(engine)
        worst = max(_kl(x, y) for s, b in zip(solo, batched) for x, y in zip(s, b))
        assert worst < 1e-3, worst
    finally:
        engine.close()


def test_attention_runs_group_short_sequences_and_keep_chunks_alone():
    """GpuBackend's attention launches for a ragged batch (no GPU needed to plan them): a prompt chunk of `tiled` rows
    or more alone (the tiled kernel, its sequence named), each run of consecutive shorter sequences in one launch."""
    from hybrid.backends.gpu import _attention_runs  # noqa: PLC0415 - the module imports without CuPy

    spans = [(0, 1), (1, 2), (2, 22), (22, 23), (23, 29), (29, 29), (29, 45)]
    assert _attention_runs(spans, 16) == [(0, 2, None), (2, 22, 2), (22, 29, None), (29, 45, 6)]
    assert _attention_runs(spans, 100) == [(0, 45, None)]
    assert _attention_runs([(0, 0)], 16) == []
