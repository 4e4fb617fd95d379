"""The GPU MoE FFN (kernels_gpu.moe, GpuBackend.fused_moe): routing vs blocks.route, the id matvecs vs float64,
the whole FFN vs float64 on the routes it chose, and engines with the fused MoE vs the op-by-op reference
(decode inside one CUDA graph, prefill, op offload), and the qwen3moe golden fixtures with every layer on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import hybrid.model.arch.blocks as blocks  # noqa: E402
from hybrid.backends.gpu import GpuBackend  # noqa: E402
from hybrid.backends.offload import OffloadBackend  # noqa: E402
from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.sampling import log_softmax  # noqa: E402
from hybrid.tools.synth.model import ModelShape, make_model  # noqa: E402
from kernels_gpu import moe  # noqa: E402
import kernels_gpu.matmul as km  # noqa: E402
from kernels_gpu.matmul import Q8_MATVEC  # noqa: E402
from test_kernels_gpu import NMSE_MATVEC, nmse, random_weight, ref_matmul, ref_matmul_q8  # noqa: E402

pytestmark = pytest.mark.gpu

NMSE_MOE_DECODE = 5e-4  # 8-bit activations (Q4_K / Q6_K experts) vs float64 on exact activations: as a q8 matvec
NMSE_MOE_PREFILL = 1e-4  # fp16 GEMMs, the GLU output rounded to fp16 between them
KL_FUSED_VS_REFERENCE = 1e-3  # same kernels but the sum's order and (decode) the GLU's q8 rounding per slot
SHAPE = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1024, n_swa=32)


def softmax64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def route_check(logits: np.ndarray, k: int, norm: bool) -> int:
    """moe.route vs blocks.route on logits; returns the number of tokens left out as near ties (k-th and (k+1)-th
    or any two of the top k+1 probabilities within 1e-6), asserting everything else equal."""
    ids, w = (a.get() for a in moe.route(cupy.asarray(logits), k, norm))
    rid, rw = blocks.route(logits, k, norm)
    top = -np.sort(-softmax64(logits), axis=1)[:, :k + 1]
    tie = (np.diff(-top, axis=1) < 1e-6).any(axis=1)
    exact_dup = np.array([len(set(r[:k + 1].tolist())) <= k for r in np.sort(-logits, axis=1)])
    check = ~tie | exact_dup  # exact duplicates must still agree: the lower expert first
    assert np.array_equal(ids[check], rid[check])
    np.testing.assert_allclose(w[check], rw[check], rtol=1e-5, atol=1e-7)
    return int((~check).sum())


@pytest.mark.parametrize("n_tok,n_expert,k,norm", [(1, 128, 8, True), (5, 64, 8, True), (300, 128, 8, True),
                                                   (7, 256, 8, False), (3, 8, 2, True), (2, 1000, 4, True)])
def test_route_matches_reference(n_tok, n_expert, k, norm):
    rng = np.random.default_rng(n_tok * n_expert)
    logits = (rng.standard_normal((n_tok, n_expert)) * 2).astype(np.float32)
    logits[0, 1] = logits[0, 5] = logits[0].max() + 1  # an exact tie at the top: expert 1 first, as a stable sort
    assert route_check(logits, k, norm) <= max(1, n_tok // 100)


def test_route_on_a_fixture_router(fixtures_dir):
    from gguf_io import open_gguf

    from hybrid.model.weights import load_weights
    from gguf_io import ModelConfig

    with open_gguf(fixtures_dir / "arch" / "qwen3moe-q4_k_m.gguf") as f:
        cfg = ModelConfig.from_gguf(f)
        lw = load_weights(f, cfg).layers[1]
        gpu = GpuBackend()
        h = np.random.default_rng(3).standard_normal((256, cfg.n_embd)).astype(np.float32)
        logits = gpu.matmul(gpu.upload(lw["ffn_gate_inp"]), h).get()
    ties = route_check(logits, cfg.n_expert_used, True)
    assert ties <= 3, ties


@pytest.mark.parametrize("n_expert,n_in", [(128, 2048), (64, 1024), (256, 512), (8, 256)])
@pytest.mark.parametrize("gated", [False, True])
def test_router_route_equals_the_two_launches(n_expert, n_in, gated):
    """moe_router_route (a decode token's router, routing and q8 input in one launch) gives exactly the ids, weights
    and q8 activations of the router matmul + route_with + quantize_q8_1, launch after launch (its CTA count goes
    back to 0)."""
    from kernels_gpu.matmul import matmul, quantize_q8_1

    rng = np.random.default_rng(n_expert + n_in)
    k = min(8, n_expert)
    w = (rng.standard_normal((n_expert, n_in)) * 0.05).astype(np.float32)
    done = cupy.zeros(1, dtype=cupy.uint32)
    if gated:  # sigmoid with a selection bias in groups, as deepseek2/glm4moe
        groups = 4 if n_expert % 4 == 0 else 1
        r = moe.Router(k, True, "sigmoid", 2.5, groups, max(1, groups // 2), None,
                       cupy.asarray(rng.standard_normal(n_expert).astype(np.float32) * 0.1), done)
    else:
        r = moe.Router(k, True, done=done)
    wd = cupy.asarray(w.view(np.uint8))
    for rep in range(3):
        x = cupy.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
        fused = moe.router_route(x, (wd, "F32"), r, q8=True)
        assert fused is not None
        ids, wts, (xq, xm) = fused
        rid, rwt = moe.route_with(matmul(wd, "F32", x), r)
        assert np.array_equal(ids.get(), rid.get()), rep
        assert np.array_equal(wts.get(), rwt.get()), rep
        qq, qm = quantize_q8_1(x)
        assert np.array_equal(xq.get(), qq.get()) and np.array_equal(xm.get(), qm.get())
        assert int(done.get()[0]) == 0
    assert moe.router_route(cupy.zeros((2, n_in), cupy.float32), (wd, "F32"), r, q8=True) is None  # one token only
    assert moe.router_route(x, (wd, "F32"), moe.Router(k, True), q8=True) is None  # no counter


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q8_0", "Q6_K"), ("IQ4_XS", "IQ4_XS", "Q8_0")])
@pytest.mark.parametrize("n_tok", [1, 3, 40])
def test_moe_ffn_one_launch_router_and_residual(types, n_tok):
    """moe_ffn with the one-launch router (a Router with a counter) and a residual equals moe_ffn without both plus
    the residual, bit for bit: the same logits, routing, q8 activations and sums."""
    rng = np.random.default_rng(5)
    n_expert, k, n_embd, n_ff = 16, 4, 512, 256
    gate, up = (_experts(t, n_expert, n_ff, n_embd, rng, 0.05) for t in types[:2])
    down = _experts(types[2], n_expert, n_embd, n_ff, rng, 0.05)
    router = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
    h = cupy.asarray(rng.standard_normal((n_tok, n_embd)).astype(np.float32))
    res = cupy.asarray(rng.standard_normal((n_tok, n_embd)).astype(np.float32))
    dev = [cupy.asarray(a) for a in (router.view(np.uint8), gate, up, down)]
    ws = ((dev[0], "F32"), (dev[1], types[0]), (dev[2], types[1]), (dev[3], types[2]))
    plain = moe.moe_ffn(h, *ws, moe.Router(k, True), "silu")
    fused = moe.moe_ffn(h, *ws, moe.Router(k, True, done=cupy.zeros(1, cupy.uint32)), "silu", residual=res)
    assert np.array_equal(fused.get(), (res + plain).get())


def _experts(type_name: str, n_expert: int, n_out: int, n_in: int, rng, scale: float = 1.0) -> np.ndarray:
    return np.stack([random_weight(type_name, n_out, n_in, rng, scale) for _ in range(n_expert)])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q3_K", "IQ4_XS", "IQ4_NL", "MXFP4",
                                       "IQ2_XXS", "IQ3_S", "IQ1_M"])
@pytest.mark.parametrize("n_tok,k,pair", [(1, 4, True), (3, 2, True), (1, 8, False)])
@pytest.mark.parametrize("n_in", [512, 4096])  # q8 types: short rows (<= 32 items, several rows a warp) and long
def test_id_matvec_vs_float64(type_name, n_tok, k, pair, n_in):
    rng = np.random.default_rng(11)
    n_expert, n_out = 6, 72
    raws = [_experts(type_name, n_expert, n_out, n_in, rng) for _ in range(2 if pair else 1)]
    ids = rng.integers(0, n_expert, n_tok * k).astype(np.int32)
    x_div = k if pair else 1  # gate/up: the token's x for its k slots; down: one x row a slot
    x = rng.standard_normal((n_tok if pair else n_tok * k, n_in)).astype(np.float32)
    ys = moe.id_matvec([cupy.asarray(r) for r in raws], type_name, cupy.asarray(x), cupy.asarray(ids), x_div)
    ref_fn = ref_matmul_q8 if type_name in Q8_MATVEC else ref_matmul
    for raw, y in zip(raws, ys):
        for s, e in enumerate(ids):
            ref = ref_fn(raw[e], type_name, x[s // x_div][None])
            assert nmse(y.get()[s], ref[0]) < NMSE_MATVEC, (s, e)


def ref_moe(h, ids, w, gate, up, down, types) -> np.ndarray:
    """float64: sum over a token's slots of w * down[e] @ (silu(gate[e] @ h) * up[e] @ h)."""
    out = np.zeros((h.shape[0], down.shape[1]))
    for t in range(h.shape[0]):
        for j, e in enumerate(ids[t]):
            g = ref_matmul(gate[e], types[0], h[t][None])[0]
            u = ref_matmul(up[e], types[1], h[t][None])[0]
            a = g / (1 + np.exp(-g)) * u
            out[t] += w[t, j] * ref_matmul(down[e], types[2], a[None])[0]
    return out


@pytest.mark.parametrize("n_tok", [1, 2, 8, 9, 64, 300])
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q5_K"),
                                   ("Q4_K", "Q8_0", "Q6_K")])  # gate and up of two types: dequantize + cuBLAS
def test_moe_ffn_vs_float64(n_tok, types):
    rng = np.random.default_rng(n_tok)
    n_expert, k, n_embd, n_ff = 16, 4, 512, 256
    # scales that keep the GLU output inside fp16's range (the prefill GEMMs take it as fp16, as llama.cpp's cuBLAS path)
    gate, up = (_experts(t, n_expert, n_ff, n_embd, rng, 0.05) for t in types[:2])
    down = _experts(types[2], n_expert, n_embd, n_ff, rng, 0.05)
    router = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    dev = [cupy.asarray(a) for a in (router.view(np.uint8), gate, up, down)]
    got = moe.moe_ffn(cupy.asarray(h), (dev[0], "F32"), (dev[1], types[0]), (dev[2], types[1]), (dev[3], types[2]),
                      moe.Router(k, True), "silu").get()
    ids, w = (a.get() for a in moe.route(cupy.asarray(h @ router.T), k, True))
    ref = ref_moe(h, ids, w, gate, up, down, types)
    tol = NMSE_MOE_DECODE if n_tok <= 8 else NMSE_MOE_PREFILL
    assert nmse(got, ref) < tol


@pytest.mark.parametrize("n_tok,n_expert,k", [(9, 16, 4), (64, 128, 8), (512, 128, 8), (10, 8, 8), (300, 4, 1),
                                             (4096, 1000, 8)])
@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_group_covers_every_pair_once_in_its_experts_tiles(n_tok, n_expert, k, skew):
    """prefill_mma's layout (moe_group on the device): rows grouped by expert, experts in order, no padding, tiles
    of at most MM_BM rows of one expert, as few as MM_BM allows, within the grid's bound."""
    rng = np.random.default_rng(n_tok + k)
    logits = rng.standard_normal((n_tok, n_expert)) * np.linspace(0.1, 3, n_expert)
    logits[:, : n_expert // 8] += skew
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    tiles, n_tiles, src, dest = (a.get() for a in moe.group(cupy.asarray(ids), n_expert))
    flat = ids.reshape(-1)
    assert src.shape == dest.shape == flat.shape and 0 < int(n_tiles[0]) <= tiles.shape[0]
    expert_of_row = np.full(flat.size, -1)
    for e, row0, rows, zero in tiles[:int(n_tiles[0])].tolist():
        assert 0 < rows <= moe.MM_BM and zero == 0 and np.all(expert_of_row[row0:row0 + rows] == -1)
        expert_of_row[row0:row0 + rows] = e
    assert np.all(expert_of_row >= 0)  # the tiles cover every row once
    assert np.all(np.diff(expert_of_row) >= 0)  # groups in expert order
    assert sorted(dest.tolist()) == list(range(flat.size))  # one row per pair
    assert np.array_equal(src[dest], np.arange(flat.size) // k)  # ... holding its token
    assert np.array_equal(expert_of_row[dest], flat)  # ... in its expert's group
    counts = np.bincount(flat, minlength=n_expert)
    assert int(n_tiles[0]) == int((-(-counts // moe.MM_BM)).sum())


def _glu64(g: np.ndarray, u: np.ndarray, act: str) -> np.ndarray:
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    x, y = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)  # gpt-oss's clamped SwiGLU
    return x / (1 + np.exp(-1.702 * x)) * (y + 1)


@pytest.mark.parametrize("gate_t,down_t,n_embd,n_ff,act,bias", [
    ("Q4_K", "Q6_K", 512, 256, "silu", False),
    ("Q4_0", "Q8_0", 320, 96, "silu", False),  # a 64-element last K chunk; 96 columns: a partial column tile
    ("MXFP4", "MXFP4", 320, 160, "swiglu_oai", True),  # gpt-oss: bias rows, the clamped SwiGLU
    ("IQ4_XS", "Q5_K", 512, 256, "silu", False),
    ("Q2_K", "Q3_K", 256, 256, "silu", False),
    ("IQ2_XXS", "IQ3_S", 256, 256, "silu", False),
])
@pytest.mark.parametrize("n_tok", [9, 200])
def test_prefill_mma_vs_float64(gate_t, down_t, n_embd, n_ff, act, bias, n_tok):
    """The tensor-core grouped GEMMs (moe_mma.cu) on skewed routes: expert 0 takes most tokens (several tiles of
    MM_BM rows), some experts none; float64 reference on the same routes."""
    rng = np.random.default_rng(n_tok + n_ff)
    n_expert, k = 8, 3
    gate, up = (_experts(gate_t, n_expert, n_ff, n_embd, rng, 0.05) for _ in range(2))
    down = _experts(down_t, n_expert, n_embd, n_ff, rng, 0.05)
    scores = rng.random((n_tok, n_expert))
    scores[:, 0] += 1.0  # every token picks expert 0
    scores[:, 7] -= 1.0  # and none picks 7
    ids = np.argsort(-scores, axis=1)[:, :k].astype(np.int32)
    w = rng.random((n_tok, k)).astype(np.float32)
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    biases = tuple(rng.standard_normal((n_expert, n)).astype(np.float32) * 0.1 if bias else None
                   for n in (n_ff, n_ff, n_embd))
    dev = [cupy.asarray(a) for a in (gate, up, down)]
    assert moe.mma_why_not((dev[0], gate_t), (dev[1], gate_t), (dev[2], down_t)) == ""
    got = moe.prefill_mma(cupy.asarray(h), cupy.asarray(ids), cupy.asarray(w), (dev[0], gate_t), (dev[1], gate_t),
                          (dev[2], down_t), act, tuple(None if b is None else cupy.asarray(b) for b in biases)).get()
    zero = (np.zeros((n_expert, n_ff)), np.zeros((n_expert, n_ff)), np.zeros((n_expert, n_embd)))
    bg, bu, bd = (z if b is None else b.astype(np.float64) for b, z in zip(biases, zero))
    ref = np.zeros((n_tok, n_embd))
    for t in range(n_tok):
        for j, e in enumerate(ids[t]):
            g = ref_matmul(gate[e], gate_t, h[t][None])[0] + bg[e]
            u = ref_matmul(up[e], gate_t, h[t][None])[0] + bu[e]
            ref[t] += w[t, j] * (ref_matmul(down[e], down_t, _glu64(g, u, act)[None])[0] + bd[e])
    assert nmse(got, ref) < NMSE_MOE_PREFILL


def test_mma_why_not():
    """prefill_mma takes gate and up of one type (moe_ffn's prefill otherwise dequantizes for cuBLAS)."""
    rng = np.random.default_rng(5)
    q4, q8, q6 = (cupy.asarray(_experts(t, 4, 64, 256, rng, 0.05)) for t in ("Q4_K", "Q8_0", "Q6_K"))
    down = cupy.asarray(_experts("Q6_K", 4, 256, 256, rng, 0.05))
    assert moe.mma_why_not((q4, "Q4_K"), (q4, "Q4_K"), (down, "Q6_K")) == ""
    assert "differ" in moe.mma_why_not((q4, "Q4_K"), (q8, "Q8_0"), (down, "Q6_K"))
    assert moe.mma_why_not((q6, "Q6_K"), (q6, "Q6_K"), (down, "Q6_K")) == ""


def _kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    pa = np.exp(a)
    return (pa * (a - b)).sum(-1)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe-q4_k_m.gguf"
    make_model(path, "qwen3moe", SHAPE, "Q4_K_M", seed=11, threads=4)
    return path


def _run(path, ngl, seq, fused: bool, monkeypatch, op_offload: bool = False) -> tuple[np.ndarray, np.ndarray, list]:
    """(decode log-probs token by token, prefill log-probs, graph reports) with the fused MoE on or off."""
    with monkeypatch.context() as m:
        # the products of 9-64 rows on the float GEMM in both runs (not the 8-bit tensor-core kernel): the comparison
        # isolates the fused MoE
        m.setattr(km, "MMQ_MAX_TOKENS", 0)
        if not fused:
            m.setattr(GpuBackend, "fused_moe", lambda *a: None)
            m.setattr(OffloadBackend, "fused_moe", lambda *a: None)
        eng = Engine.load(path, EngineParams(n_ctx=192, n_batch=96, n_ubatch=96, n_gpu_layers=ngl,
                                             op_offload=op_offload))
        try:
            cache = eng.new_cache()
            decode = np.stack([eng.eval([int(t)], cache) for t in seq[:24]])
            prefill = eng.eval(seq, eng.new_cache(), logits_from=0)
            gpus = {id(b): b for b in (*eng.backends, eng.output_backend) if hasattr(b, "decode_step")}.values()
            return log_softmax(decode), log_softmax(prefill), [(b.graph_report(), b.graph_fallback) for b in gpus]
        finally:
            eng.close()


def test_engine_fused_moe_is_one_graph_and_matches_reference(moe_model, monkeypatch):
    seq = np.random.default_rng(7).integers(3, SHAPE.n_vocab, 96)
    seq[0] = 1
    dec, pre, reports = _run(moe_model, "all", seq, True, monkeypatch)
    ref_dec, ref_pre, _ = _run(moe_model, "all", seq, False, monkeypatch)
    assert reports and not any(fb for _, fb in reports), reports  # MoE layers inside the decode graph
    assert "captured" in reports[0][0], reports
    kd, kp = _kl(ref_dec, dec), _kl(ref_pre, pre)
    assert np.isfinite(dec).all() and np.isfinite(pre).all()
    assert np.median(kd) < KL_FUSED_VS_REFERENCE and np.median(kp) < KL_FUSED_VS_REFERENCE, (kd.max(), kp.max())
    assert (kp < KL_FUSED_VS_REFERENCE).mean() >= 0.95, kp.max()  # a router near tie may flip one token's experts


def test_op_offload_fused_moe_matches_reference(moe_model, monkeypatch):
    seq = np.random.default_rng(8).integers(3, SHAPE.n_vocab, 96)
    seq[0] = 1
    _, pre, _ = _run(moe_model, "1", seq, True, monkeypatch, op_offload=True)
    _, ref_pre, _ = _run(moe_model, "1", seq, False, monkeypatch, op_offload=True)
    kp = _kl(ref_pre, pre)
    assert np.isfinite(pre).all()
    assert np.median(kp) < KL_FUSED_VS_REFERENCE and (kp < KL_FUSED_VS_REFERENCE).mean() >= 0.95, kp.max()


@pytest.mark.parametrize("name", ["qwen3moe-q4_k_m", "qwen3moe-skew-q4_k"])
def test_golden_moe_fixture_on_the_gpu(fixtures_dir, name):
    """llama.cpp's top-20 log-probs on the fixture (tests/test_golden_arch.py's scoring) with every layer on the
    GPU, the fused MoE path: the issue's bounds for MoE files (top-1 >= 0.75, median KL < 5e-2), measured values
    printed. PPL within 3% (the CPU's is within 1%: fp16 prefill GEMMs here; measured on the H200: +2.0% on the
    skewed file, whose perplexity is in the millions)."""
    from test_golden_arch import agreement

    ref = np.load(fixtures_dir / "arch" / f"{name}.GPL-3.npz")
    engine = Engine.load(fixtures_dir / "arch" / f"{name}.gguf",
                         EngineParams(n_ctx=128, n_batch=128, n_ubatch=128, n_gpu_layers="all"))
    try:
        top1, kl, ppl = agreement(engine, ref)
    finally:
        engine.close()
    print(f"{name} on the GPU: top-1 {top1:.4f}, median KL {np.median(kl):.2e}, PPL {ppl:.3f} vs {float(ref['ppl']):.3f}")
    assert top1 >= 0.75 and np.median(kl) < 5e-2, (top1, np.median(kl))
    assert abs(ppl / float(ref["ppl"]) - 1) < 0.03, (ppl, float(ref["ppl"]))
