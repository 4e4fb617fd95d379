"""CpuBackend's fused MoE FFN (hybrid/backends/cpu_moe.py, kernels_cpu/moe.py, kernels_cpu/moe_route.py) equals the
op-by-op path of blocks.moe_ffn bit for bit: the compiled routing equals blocks.route (random logits, exact ties, the
fixture models' router logits); the FFN equals it for decode batches (integer dots) and prefill batches (groups of
SMALL_BATCH_TOKENS tokens through the float GEMM, smaller ones through the dots, in one call), with repacked and file
layouts; and the fused form steps aside where it has none (float experts, Q4_1/Q5_1 prefill).

kernels_cpu.moe sends a group of SMALL_BATCH_TOKENS or more to the GEMM on every host; the op-by-op path's matmul
does so where the host's crossover is 64 (no VNNI; with VNNI some types never take the GEMM, and the two differ by
float32 rounding there). The matmul crossover is pinned to that of a host without VNNI here: every host compares
both paths bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.backends.cpu_moe import moe_fusable
from hybrid.engine import Engine, EngineParams
from hybrid.kv.paged import PagedKV
from hybrid.model.arch.blocks import moe_ffn, route
from hybrid.model.weights import Weight
from hybrid.tools.synth.model import make_model
from kernels_cpu import matmul as km
from kernels_cpu.matmul import SMALL_BATCH_TOKENS
from kernels_cpu.moe_route import group_pairs, route_topk

FIXTURES = ("qwen3moe-q4_k_m", "qwen3moe-skew-q4_k", "qwen3moe-f16")
INTEGER = FIXTURES[:2]  # expert types the fused form covers (the f16 file's experts are F16)


@pytest.fixture(autouse=True)
def _crossover_without_vnni(monkeypatch):
    monkeypatch.setattr(km, "_host_vnni", lambda: False)


def _same_routing(logits: np.ndarray, n_used: int, normalize: bool) -> tuple[int, int]:
    """(rows whose ids differ, weights that differ) between route_topk and blocks.route."""
    ids_ref, w_ref = route(logits, n_used, normalize)
    ids, w = route_topk(np.ascontiguousarray(logits, dtype=np.float32), n_used, normalize)
    assert ids.shape == ids_ref.shape and w.dtype == np.float32
    rows = np.any(ids != ids_ref, axis=1)
    return int(rows.sum()), int(np.count_nonzero(w[~rows] != w_ref[~rows]))


@pytest.mark.parametrize("n_expert, n_used, normalize", [(8, 2, True), (64, 8, True), (128, 8, True),
                                                         (64, 8, False), (60, 6, True), (3, 1, False)])
def test_route_equals_blocks_route(n_expert, n_used, normalize):
    rng = np.random.default_rng(n_expert + n_used)
    for scale in (0.01, 1.0, 8.0, 60.0):  # from near-uniform to one expert taking all (p underflows to 0 too)
        logits = (rng.standard_normal((400, n_expert)) * scale).astype(np.float32)
        assert _same_routing(logits, n_used, normalize) == (0, 0), scale
    ties = np.round(rng.standard_normal((400, n_expert)) * 2).astype(np.float32) / 2  # many equal logits
    assert _same_routing(ties, n_used, normalize) == (0, 0)
    ids, _ = route_topk(np.zeros((1, n_expert), np.float32), n_used, normalize)
    assert ids[0].tolist() == list(range(n_used))  # all equal: the lower indices first


def test_route_clamps_the_sum():
    logits = np.full((1, 64), -1e4, np.float32)
    logits[0, 0] = 0.0  # every other p underflows to 0: the renormalizing sum is p of expert 0 alone
    ids, w = route_topk(logits, 4, True)
    ids_ref, w_ref = route(logits, 4, True)
    assert np.array_equal(ids, ids_ref) and np.array_equal(w, w_ref)
    assert ids[0].tolist() == [0, 1, 2, 3] and w[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_group_pairs():
    ids = np.array([[3, 0], [0, 2], [3, 2], [1, 0]], dtype=np.int64)
    offsets, pair_tok, pair_of, used = group_pairs(ids, 5)
    assert offsets.tolist() == [0, 3, 4, 6, 8, 8] and used.tolist() == [0, 1, 2, 3]
    assert pair_tok.tolist() == [0, 1, 3, 3, 1, 2, 0, 2]  # by expert, then token (np.nonzero(ids == e))
    for t in range(4):
        for k in range(2):
            e, p = ids[t, k], pair_of[t, k]
            assert offsets[e] <= p < offsets[e + 1] and pair_tok[p] == t


def _record(eng: Engine, tokens) -> list[tuple[dict, np.ndarray]]:
    """(layer weights, normed FFN input h) of every MoE layer of one op-by-op eval of tokens."""
    seen = []

    def record(spec, cfg, lw, h, residual=None):
        seen.append((lw, np.array(h)))
        return None

    eng.cpu.fused = False
    eng.cpu.fused_moe = record
    try:
        eng.eval(tokens, eng.new_cache())
    finally:
        del eng.cpu.fused_moe
    return seen


def _recorded(fixtures_dir, name: str):
    """(name, engine, recorded (lw, h) of a 128-token prompt) of a fixture model; close the engine after."""
    eng = Engine.load(fixtures_dir / "arch" / f"{name}.gguf", EngineParams(n_ctx=128, n_batch=128, n_ubatch=128))
    tokens = np.load(fixtures_dir / "arch" / f"{name}.GPL-3.npz")["tokens"][0]
    return name, eng, _record(eng, tokens)


@pytest.fixture(scope="module", params=FIXTURES)
def fixture_model(request, fixtures_dir):
    recorded = _recorded(fixtures_dir, request.param)
    yield recorded
    recorded[1].close()


def test_route_on_fixture_router_logits(fixture_model):
    name, eng, seen = fixture_model
    assert len(seen) == eng.config.n_layer
    for lw, h in seen:
        logits = eng.cpu.matmul(lw["ffn_gate_inp"], h)
        assert _same_routing(logits, eng.config.n_expert_used, eng.spec.moe_norm_weights) == (0, 0)


def _fused_and_plain(eng: Engine, lw, h: np.ndarray):
    eng.cpu.fused = True
    fused = eng.cpu.fused_moe(eng.spec, eng.config, lw, h)
    eng.cpu.fused = False
    return fused, moe_ffn(eng.cpu, eng.spec, eng.config, lw, h)


@pytest.mark.parametrize("n_tok", [1, 2, 4, 16, 63, 64, 128, 256])
def test_fused_moe_equals_op_by_op(fixture_model, n_tok):
    name, eng, seen = fixture_model
    big_groups = 0
    for lw, h in seen:
        x = np.concatenate([h, h[::-1] * 0.5])[:n_tok]  # 256: two prompts' worth
        fused, plain = _fused_and_plain(eng, lw, x)
        if name not in INTEGER:
            assert fused is None and not moe_fusable(eng.spec, lw)  # float experts: op by op
            continue
        assert fused is not None and fused.dtype == np.float32 and np.isfinite(fused).all()
        assert np.array_equal(fused, plain), f"max |diff| {np.abs(fused - plain).max()}"
        ids, _ = route(eng.cpu.matmul(lw["ffn_gate_inp"], x), eng.config.n_expert_used, True)
        big_groups += int((np.bincount(ids.ravel()) >= SMALL_BATCH_TOKENS).sum())
    if name == "qwen3moe-skew-q4_k" and n_tok >= 128 or name == "qwen3moe-q4_k_m" and n_tok == 256:
        assert big_groups, "no expert group went through the GEMM"  # the hot experts of the skewed model


def _assert_fused_evals_equal(eng: Engine, steps: list[list[int]], new_cache=None) -> None:
    """The same evals (on one cache each way) with the fused forms and op by op give equal logits, bit for bit."""
    out = {}
    for fused in (True, False):
        eng.cpu.fused = fused
        cache = eng.new_cache(paged=False) if new_cache is None else new_cache()
        out[fused] = [np.asarray(eng.eval(tokens, cache)) for tokens in steps]
    for step, (a, b) in enumerate(zip(out[True], out[False])):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


@pytest.mark.parametrize("whole,repack,paged", [(True, True, False), (True, False, False), (False, True, False),
                                                (False, False, False), (True, True, True), (False, True, True)])
def test_engine_fused_equals_op_by_op(fixtures_dir, repack, whole, paged):
    """A prompt of 128 (GEMM groups) and of 12 tokens, then decode steps, through the whole model; decode-sized
    batches take the whole-layer call (CpuBackend.fused_layer, kernels_cpu.moe.moe_layer), or without it the two
    halves (attention_half, moe_ffn_half); on a contiguous cache and on a paged sequence (blocks of 16 positions,
    taken as the sequence grows: the call reads them through its table)."""
    eng = Engine.load(fixtures_dir / "arch" / "qwen3moe-skew-q4_k.gguf", EngineParams(n_ctx=160, repack=repack))
    types = {eng.weights.layers[0][n].type_name for n in ("ffn_gate_exps", "ffn_down_exps")}
    assert types == ({"Q4_K_X8"} if repack else {"Q4_K"})
    steps = [list(range(3, 131)), *[[5 + i] for i in range(3)], list(range(40, 52)), [9]]
    halves, layers = [], []  # the FFN halves and whole layers called, None where they had no fused form
    real, real_layer = eng.cpu._moe.ffn_half, eng.cpu.fused_layer
    eng.cpu._moe.ffn_half = lambda *args: halves.append(real(*args)) or halves[-1]
    eng.cpu.fused_layer = lambda *args: layers.append(real_layer(*args) if whole else None) or layers[-1]
    pool = PagedKV(eng.config, eng.backends, 24, block_size=16) if paged else None
    if paged:
        pool.sequence(64).reserve(64)  # another sequence's blocks first: the table is not the identity
    _assert_fused_evals_equal(eng, steps, (lambda: pool.sequence(160)) if paged else None)
    n_fused = (len(steps) - 1) * eng.config.n_layer  # every step but the prompt of 128
    assert len(layers) == 2 * len(steps) * eng.config.n_layer  # both ways: fused, then op by op
    assert sum(x is not None for x in layers) == (n_fused if whole else 0)
    assert sum(h is not None for h in halves) == (0 if whole else n_fused)
    eng.close()


def test_router_of_another_type(fixture_model):
    """A router that is not F32 (here F16): its product goes through kernels_cpu.matmul, for few tokens too."""
    name, eng, seen = fixture_model
    if name not in INTEGER:
        pytest.skip("float experts: no fused form")
    lw, h = seen[0]
    router = lw["ffn_gate_inp"]
    f16 = router.raw.view(np.float32).astype(np.float16).view(np.uint8)
    lw = {**lw, "ffn_gate_inp": Weight(router.name, "F16", router.shape, f16)}
    for n_tok in (1, 3, 128):
        fused, plain = _fused_and_plain(eng, lw, h[:n_tok])
        assert fused is not None and np.array_equal(fused, plain)
    eng.cpu.fused = True
    assert eng.cpu.fused_ffn(eng.spec, eng.config, lw, h[:1], h[1:2]) is None  # the half wants an F32 router


def test_q4_1_experts_decode_only(tmp_path):
    """Q4_1 experts: fused for few tokens (integer dots); a batch that may form a GEMM group goes op by op."""
    path = tmp_path / "moe-q4_1.gguf"
    make_model(path, "qwen3moe", "tiny", "Q4_1", seed=3, n_layer=1)
    eng = Engine.load(path, EngineParams(n_ctx=96))
    lw = eng.weights.layers[0]
    assert lw["ffn_up_exps"].type_name == "Q4_1" and moe_fusable(eng.spec, lw)
    h = np.random.default_rng(0).standard_normal((SMALL_BATCH_TOKENS, eng.config.n_embd)).astype(np.float32)
    fused, plain = _fused_and_plain(eng, lw, h[:5])
    assert fused is not None and np.array_equal(fused, plain)
    eng.cpu.fused = True
    assert eng.cpu.fused_moe(eng.spec, eng.config, lw, h) is None
    eng.close()


# -- the gated routings and expert biases (gpt-oss, glm4moe, deepseek2): routed on the host, experts compiled --------

GATED = ("gpt-oss-mxfp4", "gpt-oss-q4_k_m", "glm4moe-q4_k_m", "deepseek2-q4_k_m")


@pytest.fixture(scope="module", params=GATED)
def gated_model(request, fixtures_dir):
    recorded = _recorded(fixtures_dir, request.param)
    yield recorded
    recorded[1].close()


@pytest.mark.parametrize("n_tok", [1, 3, 64, 128])
def test_gated_fused_moe_equals_op_by_op(gated_model, n_tok):
    """Sigmoid gating with the selection bias and groups, softmax of the selected (gpt-oss), the router's and the
    experts' biases and the clamped SwiGLU: the fused form equals the op-by-op path bit for bit."""
    name, eng, seen = gated_model
    assert seen, "no MoE layer recorded"
    for lw, h in seen:
        x = np.concatenate([h, h[::-1] * 0.5])[:n_tok]
        routed = {k: w for k, w in lw.items() if "shexp" not in k}  # the shared expert is moe_ffn's to add
        fused, plain = _fused_and_plain(eng, routed, x)
        assert fused is not None and moe_fusable(eng.spec, lw), name
        assert np.array_equal(fused, plain), f"{name}: max |diff| {np.abs(fused - plain).max()}"
    eng.cpu.fused = True


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "glm4moe-q4_k_m"])
def test_gated_engine_fused_equals_op_by_op(fixtures_dir, name):
    """A 70-token prompt (GEMM groups where an expert takes 64 tokens), a 5-token one and decode steps."""
    eng = Engine.load(fixtures_dir / "arch" / f"{name}.gguf", EngineParams(n_ctx=128))
    steps = [list(range(3, 73)), [5], [6], list(range(40, 45)), [9]]
    _assert_fused_evals_equal(eng, steps)
    eng.close()
