"""Speculative decoding on the GPU (all layers, and split with the CPU): eval_rows gives eval's rows, greedy
speculative output equals plain greedy output with n-gram and draft-model drafts, and rollback on the GPU's KV cache
leaves it as if the rejected tokens had never been evaluated."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.draft import NgramDrafter  # noqa: E402
from hybrid.generate.draft_model import ModelDrafter  # noqa: E402
from hybrid.generate.loop import generate  # noqa: E402
from hybrid.generate.sampling import SamplingParams  # noqa: E402
from hybrid.generate.speculative import SpecStats, generate_speculative  # noqa: E402
from hybrid.tools.synth.model import ModelShape, make_model  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024)
GREEDY = SamplingParams(temp=0.0)
TIE = 1e-3  # a near-tie of the top-2 logits may flip between batch shapes (fp16 GEMM vs q8 matvec)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpuspec") / "llama-q4_k_m.gguf"
    make_model(path, "llama", SHAPE, "Q4_K_M", seed=21, threads=4)
    return path


@pytest.fixture(scope="module", params=["all", 2], ids=["ngl-all", "ngl-2"])
def engine(request, model):
    e = Engine.load(model, EngineParams(n_ctx=256, n_batch=256, n_ubatch=256, n_gpu_layers=request.param))
    yield e
    e.close()


def _prompt() -> list[int]:
    rng = np.random.default_rng(5)
    pattern = [int(t) for t in rng.integers(3, SHAPE.n_vocab, 12)]
    return [1, *pattern, *pattern, *pattern[:4]]  # a repeated pattern: prompt lookup has something to copy


def _plain(engine, prompt, n):
    """Plain greedy ids and the first step whose top-2 logits were a near-tie."""
    cache = engine.new_cache()
    logits = engine.eval(prompt, cache)
    ids, tie = [], n
    for i in range(n):
        top2 = np.partition(logits, -2)[-2:]
        if float(top2[1] - top2[0]) < TIE and tie == n:
            tie = i
        ids.append(int(np.argmax(logits)))
        logits = engine.eval([ids[-1]], cache)
    return ids, tie


def test_eval_rows_match_eval(engine):
    prompt = _prompt()
    a, b = engine.new_cache(), engine.new_cache()
    engine.eval(prompt[:-6], a)
    engine.eval(prompt[:-6], b)
    want = engine.eval(prompt[-6:], a, logits_from=0)
    rows = engine.eval_rows(prompt[-6:], b)
    got = np.stack([rows[i] for i in range(len(rows))])
    assert b.n_past == a.n_past
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * float(np.abs(want).max()))


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_greedy_speculative_equals_plain(engine, drafter):
    prompt = _prompt()
    n = 32
    ids, tie = _plain(engine, prompt, n)
    d = NgramDrafter(n=3, draft_max=6) if drafter == "ngram" else ModelDrafter(engine, SHAPE.n_vocab, p_min=0.0)
    stats = SpecStats()
    spec = list(generate_speculative(engine, prompt, GREEDY, n, engine.new_cache(), d, draft_max=6, stats=stats,
                                     adaptive=False))
    m = min(tie, len(spec), len(ids))
    assert m >= 8, f"a near-tie at step {tie}"
    assert spec[:m] == ids[:m]
    assert stats.drafted > 0


def test_rollback_on_the_gpu_cache(engine):
    prompt = _prompt()
    ref = engine.new_cache()
    engine.eval(prompt, ref)
    want = engine.eval([7, 8, 9], ref, logits_from=0)
    cache = engine.new_cache()
    engine.eval(prompt, cache)
    engine.eval([500, 600, 700, 800], cache, logits_from=0)  # evaluated, then rejected
    cache.n_past = len(prompt)
    got = engine.eval([7, 8, 9], cache, logits_from=0)
    np.testing.assert_array_equal(got, want)  # the same batch shapes both ways
    plain = list(generate(engine, prompt, GREEDY, 4, engine.new_cache()))
    assert len(plain) == 4
