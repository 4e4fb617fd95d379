"""The GPU's MoE for the gated routings (kernels_gpu.moe.Router, moe_route_gated): sigmoid with the selection bias,
groups and a scale (glm4moe, deepseek2), gpt-oss's softmax of the selected logits with the router's bias, the
experts' biases and the clamped SwiGLU; against the host's route_gated and float64, and whole engines against the
op-by-op path (routed on the host), MoE layers inside the decode graph."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.sampling import log_softmax  # noqa: E402
from hybrid.model.arch.moe import Routing, route_gated  # noqa: E402
from kernels_cpu.activations import swiglu_oai  # noqa: E402
from kernels_gpu import moe  # noqa: E402
from test_gpu_moe import NMSE_MOE_DECODE, NMSE_MOE_PREFILL, _experts, _kl, _run  # noqa: E402
from test_kernels_gpu import nmse, ref_matmul  # noqa: E402

pytestmark = pytest.mark.gpu

ROUTINGS = {  # name: (host Routing, router bias?, selection bias?)
    "glm4moe": (Routing(8, "sigmoid", True, 2.5, 0, 0), False, True),
    "deepseek3": (Routing(8, "sigmoid", True, 2.5, 8, 4), False, True),
    "sigmoid-plain": (Routing(6, "sigmoid", False, 1.0, 0, 0), False, False),
    "softmax-sel-bias": (Routing(8, "softmax", True, 1.0, 0, 0), False, True),
    "softmax-scaled": (Routing(4, "softmax", False, 1.5, 4, 2), False, False),
    "gpt-oss": (Routing(4, "softmax_weight", False, 1.0, 0, 0), True, False),
}
KL_FUSED_VS_OP_BY_OP = 1e-3  # the device's float32 routing and fused sums against the host's, per token


def _router(r: Routing, rbias, sbias) -> moe.Router:
    return moe.Router(r.n_used, r.normalize, r.gating, r.scale, r.n_groups, r.n_group_used,
                      None if rbias is None else cupy.asarray(rbias), None if sbias is None else cupy.asarray(sbias))


def _probs(z: np.ndarray, gating: str) -> np.ndarray:
    """The selection's probabilities in float64 (before the selection bias)."""
    z = z.astype(np.float64)
    if gating == "softmax_weight":
        return z
    if gating == "sigmoid":
        return 1 / (1 + np.exp(-z))
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _near_ties(score: np.ndarray, k: int, gap: float = 1e-5) -> np.ndarray:
    """Tokens whose selection scores (n, n_expert) have any two of their k + 1 best within gap of each other."""
    top = -np.sort(-score, axis=1)[:, :k + 1]
    return (np.diff(-top, axis=1) < gap).any(axis=1)


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("n_tok,n_expert", [(1, 128), (37, 64), (300, 256)])
def test_gated_route_matches_the_host(name, n_tok, n_expert):
    r, has_rbias, has_sbias = ROUTINGS[name]
    if r.n_groups > 1 and n_expert % r.n_groups:
        pytest.skip("groups of equal size only")
    rng = np.random.default_rng(n_tok + n_expert)
    logits = (rng.standard_normal((n_tok, n_expert)) * 2).astype(np.float32)
    rbias = (rng.standard_normal(n_expert) * 0.5).astype(np.float32) if has_rbias else None
    sbias = (rng.standard_normal(n_expert) * 0.1).astype(np.float32) if has_sbias else None
    ids, w = (a.get() for a in moe.route_with(cupy.asarray(logits), _router(r, rbias, sbias)))
    z = logits + rbias if rbias is not None else logits
    rid, rw = route_gated(z, r, sbias)
    # the device's float32 softmax / sigmoid differ from the host's float64 in the last bits: a selection within
    # 1e-5 may go either way (and with groups, a group's score too); everything else must agree exactly
    p = _probs(z, r.gating)
    score = p + (sbias if sbias is not None else 0)
    check = ~_near_ties(score, r.n_used)
    if r.n_groups > 1:
        g = -np.sort(-score.reshape(n_tok, r.n_groups, -1), axis=2)[:, :, :2].sum(2)
        check &= ~_near_ties(g, r.n_group_used)
    assert check.mean() > 0.9, check.mean()
    assert np.array_equal(ids[check], rid[check]), np.nonzero((ids != rid).any(1) & check)
    np.testing.assert_allclose(w[check], rw[check], rtol=2e-5, atol=1e-6)


def test_add_bias_rows():
    rng = np.random.default_rng(1)
    y = rng.standard_normal((7, 96)).astype(np.float32)
    bias = rng.standard_normal((5, 96)).astype(np.float32)
    e = np.array([0, 4, -1, 2, 2, -1, 1], np.int32)
    got = cupy.asarray(y)
    moe.add_bias(got, cupy.asarray(bias), cupy.asarray(e))
    ref = y + np.where(e[:, None] >= 0, bias[np.maximum(e, 0)], 0)
    np.testing.assert_array_equal(got.get(), ref)


def _ref_oai(h, ids, w, gate, up, down, biases, types) -> np.ndarray:
    """float64: sum over a token's slots of w * (down[e] @ swiglu_oai(gate[e] h + bg[e], up[e] h + bu[e]) + bd[e])."""
    bg, bu, bd = biases
    out = np.zeros((h.shape[0], down.shape[1]))
    for t in range(h.shape[0]):
        for j, e in enumerate(ids[t]):
            g = ref_matmul(gate[e], types[0], h[t][None])[0] + bg[e]
            u = ref_matmul(up[e], types[1], h[t][None])[0] + bu[e]
            x, y = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            a = x / (1 + np.exp(-1.702 * x)) * (y + 1)
            out[t] += w[t, j] * (ref_matmul(down[e], types[2], a[None])[0] + bd[e])
    return out


@pytest.mark.parametrize("n_tok", [1, 3, 64, 300])
@pytest.mark.parametrize("types", [("MXFP4", "MXFP4", "MXFP4"), ("Q4_K", "Q4_K", "Q6_K")])
def test_biased_oai_experts_vs_float64(n_tok, types):
    rng = np.random.default_rng(n_tok + 5)
    n_expert, k, n_embd, n_ff = 16, 4, 512, 256
    gate, up = (_experts(t, n_expert, n_ff, n_embd, rng, 0.05) for t in types[:2])
    down = _experts(types[2], n_expert, n_embd, n_ff, rng, 0.05)
    biases = [(rng.standard_normal((n_expert, n)) * 0.3).astype(np.float32) for n in (n_ff, n_ff, n_embd)]
    router = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
    rbias = (rng.standard_normal(n_expert) * 0.5).astype(np.float32)
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    r = _router(ROUTINGS["gpt-oss"][0], rbias, None)
    dev = [cupy.asarray(a) for a in (router.view(np.uint8), gate, up, down)]
    got = moe.moe_ffn(cupy.asarray(h), (dev[0], "F32"), (dev[1], types[0]), (dev[2], types[1]), (dev[3], types[2]),
                      r, "swiglu_oai", biases=tuple(cupy.asarray(b) for b in biases)).get()
    ids, w = (a.get() for a in moe.route_with(cupy.asarray(h @ router.T), r))
    ref = _ref_oai(h, ids, w, gate, up, down, biases, types)
    assert nmse(got, ref) < (NMSE_MOE_DECODE if n_tok <= 8 else NMSE_MOE_PREFILL)


def test_glu_swiglu_oai_matches_the_cpu():
    rng = np.random.default_rng(2)
    g, u = ((rng.standard_normal(4099) * 6).astype(np.float32) for _ in range(2))
    from kernels_gpu.ops import glu  # noqa: PLC0415

    ref = swiglu_oai(g, u)
    for vec in (False, True):
        n = 4096 if vec else 4099
        got = glu(cupy.asarray(g[:n]), cupy.asarray(u[:n]), "swiglu_oai", vec=vec).get()
        np.testing.assert_allclose(got, ref[:n], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "gpt-oss-q4_k_m", "glm4moe-q4_k_m", "deepseek2-q4_k_m"])
def test_engine_gated_moe_on_the_gpu_matches_op_by_op(fixtures_dir, name, monkeypatch):
    """Every layer on the GPU: the fused MoE (device routing) against the op-by-op path (routed on the host, a
    Python loop over experts) for decode and a prompt; gpt-oss and glm4moe decode as one CUDA graph."""
    path = fixtures_dir / "arch" / f"{name}.gguf"
    seq = np.random.default_rng(9).integers(3, 1000, 80)
    seq[0] = 1
    dec, pre, reports = _run(path, "all", seq, True, monkeypatch)
    ref_dec, ref_pre, _ = _run(path, "all", seq, False, monkeypatch)
    kd, kp = _kl(ref_dec, dec), _kl(ref_pre, pre)
    print(f"{name}: fused vs op by op, median KL decode {np.median(kd):.2e}, prompt {np.median(kp):.2e}; {reports}")
    assert np.isfinite(dec).all() and np.isfinite(pre).all()
    assert np.median(kd) < KL_FUSED_VS_OP_BY_OP and np.median(kp) < KL_FUSED_VS_OP_BY_OP, (kd.max(), kp.max())
    assert (kd < KL_FUSED_VS_OP_BY_OP).mean() >= 0.9 and (kp < KL_FUSED_VS_OP_BY_OP).mean() >= 0.9
    if not name.startswith("deepseek2"):  # MLA's attention is not captured (tested elsewhere)
        assert reports and not any(fb for _, fb in reports) and "captured" in reports[0][0], reports


def test_gpt_oss_experts_in_ram_prefill_on_the_gpu(fixtures_dir):
    """--cpu-moe with op offload on: a prompt batch of at least n_expert / n_used * 32 tokens (8 / 4 * 32 = 64)
    uploads its experts and runs them, biases included, on the GPU; it matches the same placement with op offload
    off, where every batch's experts run on the CPU."""
    from hybrid.plan.overrides import build_overrides  # noqa: PLC0415

    path = fixtures_dir / "arch" / "gpt-oss-mxfp4.gguf"
    seq = np.random.default_rng(4).integers(3, 1000, 96)
    seq[0] = 1
    out = {}
    for op_offload in (True, False):
        eng = Engine.load(path, EngineParams(n_ctx=128, n_batch=96, n_ubatch=96, n_gpu_layers="all",
                                             op_offload=op_offload, overrides=build_overrides((), True, 0)))
        try:
            out[op_offload] = log_softmax(eng.eval(seq, eng.new_cache(), logits_from=0))
            gpus = {id(b): b for b in (*eng.backends, eng.output_backend) if hasattr(b, "host_experts")}.values()
            uploaded = sum(b.host_experts.stats.gpu_batches for b in gpus)
            assert (uploaded > 0) == op_offload, uploaded
        finally:
            eng.close()
    kl = _kl(out[False], out[True])
    print(f"gpt-oss --cpu-moe prefill, experts on the GPU vs the CPU: median KL {np.median(kl):.2e}")
    assert np.median(kl) < KL_FUSED_VS_OP_BY_OP and (kl < KL_FUSED_VS_OP_BY_OP).mean() >= 0.9, kl.max()
