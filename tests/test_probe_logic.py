"""The pure half of `hybrid probe` (prediction, ceiling search against a fake allocator, recommendation, KV types)
and size strings."""

from __future__ import annotations

import math

import pytest

from hybrid.errors import HybridError, PlacementError
from hybrid.plan.budget import PlanInputs
from hybrid.plan.placement import plan
from hybrid.plan.probe import (DEFAULT_MARGIN_BYTES, bisect_ceiling, find_ceiling, kv_type_table, predict_max_ngl,
                          recommend)
from hybrid.system.sizes import GiB, MiB, InvalidSize, format_pair, format_size, parse_size
from test_placement import LLAMA_8B, QWEN_32B, model


class FakeAllocator:
    """fits(n) is True up to `ceiling`; counts the calls and remembers every n asked."""

    def __init__(self, ceiling: int):
        self.ceiling, self.asked = ceiling, []

    def __call__(self, n: int) -> bool:
        self.asked.append(n)
        return n <= self.ceiling


def brute_force(fits, lo: int, hi: int) -> int:
    return max((n for n in range(lo, hi + 1) if fits(n)), default=lo - 1)


# -- bisect_ceiling ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hi", [0, 1, 5, 33, 65, 100])
def test_bisect_finds_the_brute_force_ceiling_in_log_calls(hi):
    bound = math.ceil(math.log2(hi + 2))
    for ceiling in range(-1, hi + 2):
        fake = FakeAllocator(ceiling)
        got = bisect_ceiling(fake, 0, hi)
        assert got == brute_force(lambda n: n <= ceiling, 0, hi) == min(ceiling, hi)
        assert len(fake.asked) <= bound and len(set(fake.asked)) == len(fake.asked)
        assert all(0 <= n <= hi for n in fake.asked)
        assert bisect_ceiling(FakeAllocator(ceiling), 0, hi) == got  # the same answer twice


def test_bisect_with_a_lower_bound_and_bad_range():
    assert bisect_ceiling(FakeAllocator(3), 5, 9) == 4  # nothing in [5, 9] fits: lo - 1
    assert bisect_ceiling(FakeAllocator(7), 5, 9) == 7
    with pytest.raises(ValueError):
        bisect_ceiling(FakeAllocator(7), 5, 4)


# -- find_ceiling: start from the prediction -----------------------------------------------------------------
@pytest.mark.parametrize("hi", [1, 33, 65])
def test_find_ceiling_from_any_prediction(hi):
    bound = 2 * math.ceil(math.log2(hi + 2)) + 2
    for ceiling in range(-1, hi + 1):
        for predicted in range(-2, hi + 3):
            fake = FakeAllocator(ceiling)
            s = find_ceiling(fake, predicted, hi)
            assert s.ceiling == max(ceiling, -1) and s.predicted == predicted
            assert s.calls == len(fake.asked) <= bound
            assert [n for n, _ in s.attempts] == fake.asked and len(set(fake.asked)) == len(fake.asked)
            assert all(ok == (n <= ceiling) for n, ok in s.attempts)


def test_find_ceiling_takes_two_calls_when_the_prediction_is_right():
    for ceiling in (0, 10, 32):
        assert find_ceiling(FakeAllocator(ceiling), ceiling, 33).calls == 2  # ceiling fits, ceiling + 1 does not
    assert find_ceiling(FakeAllocator(99), 33, 33).calls == 1  # everything fits: nothing above to try
    assert find_ceiling(FakeAllocator(20), 21, 33).calls == 2  # one too many: one step down


def test_find_ceiling_beats_bisection_near_the_prediction():
    fake = FakeAllocator(40)
    assert find_ceiling(fake, 42, 65).ceiling == 40 and len(fake.asked) <= 4
    plain = FakeAllocator(40)
    assert bisect_ceiling(plain, 0, 65) == 40 and len(plain.asked) >= 6


def test_probe_against_an_allocator_with_less_memory_than_reported():
    """The device says 8 GiB are free, but only 7.3 GiB can be allocated: the search finds the truth."""
    cfg, ts = model(LLAMA_8B)
    n_ctx = 32768
    predicted = predict_max_ngl(cfg, ts, 8 * GiB, PlanInputs(n_ctx=n_ctx))
    real = 8 * GiB - 700 * MiB
    calls = []

    def fits(n: int) -> bool:
        calls.append(n)
        return plan(cfg, ts, 1 << 62, n, n_ctx).gpu_total_bytes <= real

    s = find_ceiling(fits, predicted.ngl, cfg.n_layer + 1)
    truth = brute_force(lambda n: plan(cfg, ts, 1 << 62, n, n_ctx).gpu_total_bytes <= real, 0, cfg.n_layer + 1)
    assert s.ceiling == truth < predicted.ngl
    assert s.calls <= 2 * math.ceil(math.log2(predicted.ngl - truth + 1)) + 2
    assert find_ceiling(fits, predicted.ngl, cfg.n_layer + 1).ceiling == s.ceiling


# -- prediction, recommendation, KV types ------------------------------------------------------------------
def test_predict_max_ngl_matches_the_plan():
    cfg, ts = model(LLAMA_8B)
    p = predict_max_ngl(cfg, ts, 6 * GiB, PlanInputs(n_ctx=32768))
    auto = plan(cfg, ts, 6 * GiB, "auto", 32768)
    assert p.ngl == auto.n_gpu_layers and p.gpu_bytes == auto.gpu_total_bytes and p.n_offloadable == 33
    assert p.next_gpu_bytes > 6 * GiB >= p.gpu_bytes
    m = predict_max_ngl(cfg, ts, 6 * GiB, PlanInputs(n_ctx=32768), GiB)
    assert m.ngl == plan(cfg, ts, 5 * GiB, "auto", 32768).n_gpu_layers < p.ngl and m.margin_bytes == GiB
    assert predict_max_ngl(cfg, ts, 64 * GiB, PlanInputs(n_ctx=4096)).next_gpu_bytes is None
    assert predict_max_ngl(cfg, ts, 0, PlanInputs(n_ctx=4096)).ngl == 0
    assert predict_max_ngl(cfg, ts, 6 * GiB, PlanInputs(n_ctx=32768, type_k="q8_0", type_v="q8_0")).ngl >= p.ngl


def test_recommend_leaves_the_margin():
    cfg, ts = model(LLAMA_8B)
    budget, n_ctx = 8 * GiB, 32768

    def plan_fn(n: int):
        return plan(cfg, ts, budget, n, n_ctx)

    ceiling = predict_max_ngl(cfg, ts, budget, PlanInputs(n_ctx=n_ctx)).ngl
    r = recommend(ceiling, plan_fn)
    assert r.margin_bytes == DEFAULT_MARGIN_BYTES == GiB and r.limited_by == "margin"
    assert r.ngl < ceiling and r.headroom_bytes >= GiB and r.gpu_bytes == plan_fn(r.ngl).gpu_total_bytes
    assert plan_fn(r.ngl + 1).headroom_bytes < GiB
    assert r.ngl == predict_max_ngl(cfg, ts, budget, PlanInputs(n_ctx=n_ctx), GiB).ngl
    # a measured ceiling below the margin's limit wins
    low = recommend(5, plan_fn)
    assert low.ngl == 5 and low.limited_by == "ceiling"
    assert recommend(ceiling, plan_fn, 0).ngl == ceiling
    # a plan_fn that raises above the budget, and a margin nothing leaves
    assert recommend(33, plan_fn, 0).ngl == ceiling
    none = recommend(33, lambda n: plan(cfg, ts, GiB // 2, n, n_ctx), GiB)
    assert none.ngl == 0 and none.limited_by == "margin"
    assert recommend(-1, plan_fn).ngl == 0


@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN_32B], ids=["8B", "32B"])
def test_kv_type_table(shape):
    cfg, ts = model(shape)
    rows = kv_type_table(cfg, ts, 24 * GiB, PlanInputs(n_ctx=32768))
    assert [r.type_k for r in rows] == ["f16", "q8_0", "q4_0"] and all(r.type_v == r.type_k for r in rows)
    f16, q8, q4 = rows
    assert f16.kv_bytes == cfg.n_layer * 32768 * cfg.n_head_kv * 128 * 2 * 2
    assert q8.kv_bytes * 64 == f16.kv_bytes * 34 and q4.kv_bytes * 64 == f16.kv_bytes * 18
    assert f16.max_ngl <= q8.max_ngl <= q4.max_ngl
    assert f16.extra_layers == 0 and q8.extra_layers == q8.max_ngl - f16.max_ngl
    assert all(r.safe_ngl <= r.max_ngl for r in rows)
    for r in rows:
        assert r.max_ngl == plan(cfg, ts, 24 * GiB, "auto", 32768, r.type_k, r.type_v).n_gpu_layers
        assert r.safe_ngl == plan(cfg, ts, 23 * GiB, "auto", 32768, r.type_k, r.type_v).n_gpu_layers
    if shape is QWEN_32B:
        assert q8.extra_layers > 0


# -- sizes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("24gib", 24 * GiB), ("24Gi", 24 * GiB), ("512MiB", 512 * MiB),
    ("1.5G", 3 * GiB // 2), ("1.5g", 3 * GiB // 2), ("8000000000", 8_000_000_000), ("8_000_000_000", 8 * 10**9),
    ("8GB", 8 * 10**9), ("500MB", 500 * 10**6), ("4K", 4096), ("4kB", 4000), ("100B", 100), ("0", 0),
    (" 2T ", 2 << 40), (".5GiB", GiB // 2), ("1.", 1), ("0.3", 0), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "-1GiB", "1.5.2G", "24 GiBs", "12X", "iB", "1iB", "nan",
                                  "inf", "1e9", "24 G iB", -5, True, 1.5, None])
def test_parse_size_rejects_bad_input_clearly(text):
    with pytest.raises(InvalidSize) as e:
        parse_size(text)
    assert isinstance(e.value, ValueError) and isinstance(e.value, HybridError)
    assert "\n" not in str(e.value) and (repr(text) in str(e.value) or "found" in str(e.value))


def test_format_size():
    assert format_size(0) == "0 B" and format_size(1023) == "1023 B" and format_size(1024) == "1.0 KiB"
    assert format_size(512 * MiB) == "512.0 MiB" and format_size(int(23.1 * GiB)) == "23.1 GiB"
    assert format_size(3 * GiB // 2, 2) == "1.50 GiB" and format_size(-GiB) == "-1.0 GiB"
    assert format_size(5 << 40) == "5.0 TiB"
    assert format_pair(int(22.04 * GiB), 22 * GiB) == ("22.04 GiB", "22.00 GiB")
    assert format_pair(23 * GiB, 22 * GiB) == ("23.0 GiB", "22.0 GiB")
    for n in (0, 1, 1000, 5 * MiB, 3 * GiB):
        assert parse_size(format_size(n).replace(" ", "")) == n or n < 1024


def test_placement_error_is_a_hybrid_error():
    assert issubclass(PlacementError, HybridError)


# -- probe_ngl: the one chain shared by `hybrid probe` and `-ngl auto` ----------------------------------------
def test_probe_ngl_against_a_fake_allocator():
    """prediction -> attempts (each recorded, in order) -> recommendation; a dry run is the prediction alone."""
    from hybrid.engine import EngineParams
    from hybrid.engine.fit import FitAttempt, probe_ngl

    cfg, ts = model(LLAMA_8B)
    params = EngineParams(n_ctx=32768, n_batch=512, n_ubatch=512, type_k="q8_0", type_v="q8_0")
    budget = 6 * GiB
    truth = predict_max_ngl(cfg, ts, budget, PlanInputs(n_ctx=32768, type_k="q8_0", type_v="q8_0")).ngl + 2  # the device fits more
    fake = FakeAllocator(truth)
    seen = []
    r = probe_ngl(cfg, ts, params, budget, GiB, lambda n: FitAttempt(n, fake(n), 0, seconds=0.5), seen.append)
    assert r.prediction.ngl == truth - 2 and r.ceiling == r.search.ceiling == truth
    assert [a.ngl for a in r.attempts] == fake.asked == [n for n, _ in r.search.attempts] and list(r.attempts) == seen
    assert all(a.fits == (a.ngl <= truth) for a in r.attempts) and r.seconds == 0.5 * len(r.attempts)
    rec = recommend(truth, lambda n: plan(cfg, ts, budget, n, 32768, "q8_0", "q8_0", swa_full=True), GiB)
    assert r.recommendation == rec and rec.ngl <= truth
    dry = probe_ngl(cfg, ts, params, budget, GiB)
    assert dry.search is None and dry.attempts == () and dry.ceiling == r.prediction.ngl
    assert dry.recommendation.ngl <= dry.ceiling
