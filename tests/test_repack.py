"""Rows interleaved by 8 (kernels_cpu.q4_k_x8, kernels_cpu.legacy_x8, hybrid/backends/repack.py): each repacked matmul
against float64 references and against the plain kernels, the layouts' guards, what the loader repacks and what
it leaves, the released pages, and the stale Numba cache check of kernels_cpu."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.backends.repack import LAYOUTS, repack_weights
from hybrid.tools.synth.model import make_model
from kernels_cpu import drop_stale_cache, legacy_x8, q4_k_x8, vec_dot_legacy
from kernels_cpu.matmul import GEMM_MIN_TOKENS_AVX2, NEVER, REPACKED, matmul, matmuls
from test_kernels_cpu_matmul import NMSE_TOL_SAME_ACT, converted_activations, dequantize64, random_weight


def nmse(a, ref):
    return float(np.mean((np.asarray(a, np.float64) - ref) ** 2) / max(np.mean(ref ** 2), 1e-30))


# (n_out, n_blocks, n_tok): one group, groups not filling a 16-row block, a batch through the GEMM at the crossover
# of hosts without VNNI (passed, so that every host runs both paths) and through the integer dots (VNNI's prefill)
CASES = [(8, 1, 1), (24, 3, 1), (136, 2, 5), (64, 4, GEMM_MIN_TOKENS_AVX2 + 3)]
CROSSOVERS = {"gemm_from_64": GEMM_MIN_TOKENS_AVX2, "int_dots": NEVER}


@pytest.mark.parametrize("gemm_from", CROSSOVERS.values(), ids=CROSSOVERS.keys())
@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q4_K"])
@pytest.mark.parametrize("n_out, nb, n_tok", CASES)
def test_x8_matmul_matches_float64_and_plain(name, n_out, nb, n_tok, gemm_from):
    layout, _, repack = LAYOUTS[name]
    block = 256 if name == "Q4_K" else 32
    rng = np.random.default_rng(n_out + nb)
    w = random_weight(name, n_out, block * nb, rng)
    x = rng.standard_normal((n_tok, block * nb)).astype(np.float32)
    rp = repack(w)
    assert rp.shape == (n_out, nb * REPACKED[layout].type_size) and REPACKED[layout].row_group == 8
    y = matmul(rp, layout, x, gemm_from=gemm_from)
    ref = converted_activations(x, name) @ dequantize64(w, name).T
    assert nmse(y, ref) < NMSE_TOL_SAME_ACT
    plain = matmul(w, name, x, gemm_from=gemm_from)
    if n_tok >= gemm_from:  # rows decoded to the same floats, the same GEMM
        assert np.array_equal(y, plain)
    else:  # the same exact integer sums per block, summed in another float order
        assert np.allclose(y, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q4_K"])
def test_x8_decodes_rows_as_ggml(name):
    rng = np.random.default_rng(3)
    w = random_weight(name, 16, 512, rng)
    layout, _, repack = LAYOUTS[name]
    rp = repack(w)
    rb, rp = rp.shape[1], rp.reshape(-1)
    ref = dequantize64(w, name)
    out = np.empty(512, dtype=np.float32)
    for r in range(16):
        if name == "Q4_K":
            q4_k_x8.decode_row_f32(rp, r * rb, 2, out, 0)
        else:
            vec_dot_legacy.decode_row_f32(getattr(vec_dot_legacy, layout), rp, r * rb, 16, out, 0)
        assert np.allclose(out, ref[r], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name, other", [("Q4_K", "Q6_K"), ("Q5_0", "Q8_0"), ("Q4_0", "Q4_1")])
def test_x8_in_a_fused_triple_with_other_types(name, other):
    rng = np.random.default_rng(4)
    w, o = random_weight(name, 32, 512, rng), random_weight(other, 16, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    layout, _, repack = LAYOUTS[name]
    ys = matmuls([(repack(w), layout), (o, other), (w, name)], x)
    assert np.array_equal(ys[1], matmul(o, other, x))
    assert np.allclose(ys[0], ys[2], rtol=1e-5, atol=1e-5 * np.abs(ys[2]).max())


def test_x8_guards():
    rng = np.random.default_rng(5)
    assert not q4_k_x8.repackable((12, 256)) and q4_k_x8.repackable((16, 512))
    assert not legacy_x8.repackable((12, 64)) and legacy_x8.repackable((16, 64))
    with pytest.raises(ValueError, match="8-row groups"):
        q4_k_x8.repack(random_weight("Q4_K", 12, 256, rng))
    with pytest.raises(ValueError, match="8-row groups"):
        legacy_x8.repack_q5_0(random_weight("Q5_0", 12, 64, rng))
    with pytest.raises(ValueError, match="groups of 8 rows"):
        matmul(np.zeros((12, 148), dtype=np.uint8), "Q4_K_X8", np.zeros(256, dtype=np.float32))
    with pytest.raises(ValueError, match="groups of 8 rows"):
        matmul(np.zeros((4, 18), dtype=np.uint8), "Q4_0_X8", np.zeros(32, dtype=np.float32))


def _model(tmp_path, arch="llama", mix="Q4_K_M"):
    path = tmp_path / f"{arch}-{mix}.gguf"
    make_model(path, arch, "tiny", mix, seed=7, n_layer=2)
    return path


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_0", "Q4_0"])
def test_loader_repacks_cpu_matrices_and_results_agree(tmp_path, mix):
    path = _model(tmp_path, mix=mix)
    notes: list[str] = []
    a = Engine.load(path, EngineParams(n_ctx=64), progress=notes.append)
    b = Engine.load(path, EngineParams(n_ctx=64, repack=False))
    n = 0
    for la, lb in zip(a.weights.layers, b.weights.layers):
        for key, wb in lb.items():
            wa = la[key]
            if wb.type_name in LAYOUTS and wb.raw.ndim == 2:
                layout, _, repack = LAYOUTS[wb.type_name]
                assert wa.type_name == layout and wa.shape == wb.shape
                assert np.array_equal(wa.raw, repack(np.asarray(wb.raw)))
                n += 1
            else:
                assert wa.type_name == wb.type_name
    if b.weights.output is not b.weights.token_embd and b.weights.output.type_name in LAYOUTS:
        assert a.weights.output.type_name == LAYOUTS[b.weights.output.type_name][0]
        n += 1
    assert n > 0 and any(f"repack: {n} matrices" in m for m in notes)
    assert a.weights.token_embd.type_name == b.weights.token_embd.type_name  # untied: the lookup reads the file rows
    steps = [list(range(3, 15)), [7], [9], [4]]
    ca, cb = a.new_cache(), b.new_cache()
    for tokens in steps:
        la, lb = np.asarray(a.eval(tokens, ca))[-1], np.asarray(b.eval(tokens, cb))[-1]
        assert la.argmax() == lb.argmax()
        assert np.abs(la - lb).max() < 1e-3 * np.abs(lb).max()


def test_repack_releases_the_file_pages_and_skips_what_it_must(tmp_path):
    path = _model(tmp_path)
    eng = Engine.load(path, EngineParams(n_ctx=64, repack=False))
    w = eng.weights
    before = {k: v.type_name for k, v in w.layers[1].items()}
    done = repack_weights(w, [0], output=True)  # layer 1 stays as it is (as a GPU layer would)
    repacked = [v for v in w.layers[0].values() if v.type_name in REPACKED]
    assert done.n_matrices == len(repacked) > 0 and "Q4_K" in done.types
    assert {k: v.type_name for k, v in w.layers[1].items()} == before
    assert done.n_bytes == sum(v.nbytes for v in repacked)
    assert 0 < done.released_bytes <= done.n_bytes
    assert w.output is w.token_embd or w.output.type_name not in LAYOUTS


def test_no_repack_when_op_offload_streams_the_weights(tmp_path, monkeypatch):
    import hybrid.engine.engine as engine_mod

    class FakeOffload:
        def close(self):
            pass

    monkeypatch.setattr(engine_mod, "make_op_offload", lambda *a, **k: FakeOffload())
    eng = Engine.load(_model(tmp_path), EngineParams(n_ctx=64, op_offload=True))
    assert all(w.type_name not in REPACKED for lw in eng.weights.layers for w in lw.values())


def test_stale_numba_cache_is_dropped(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    entry = pkg / "__pycache__" / "a.f-1.py311.nbi"
    entry.write_bytes(b"old")
    assert drop_stale_cache(pkg) and not entry.exists()  # no stamp: made from unknown sources
    entry.write_bytes(b"new")
    assert not drop_stale_cache(pkg) and entry.exists()  # same sources: kept
    (pkg / "b.py").write_text("y = 2\n")  # another file of the package changed
    assert drop_stale_cache(pkg) and not entry.exists()


def test_repack_under_numa_and_mlock(tmp_path):
    notes: list[str] = []
    eng = Engine.load(_model(tmp_path), EngineParams(n_ctx=64, numa="distribute", use_mlock=True),
                      progress=notes.append)
    assert any(w.type_name in REPACKED for lw in eng.weights.layers for w in lw.values())
    assert any(n.startswith("numa:") for n in notes) and any("mlock" in n for n in notes)
    assert np.isfinite(np.asarray(eng.eval([3, 4, 5], eng.new_cache()))).all()


def test_repack_with_no_mmap_frees_the_copies_source_and_agrees(tmp_path):
    path = _model(tmp_path, mix="Q5_0")
    a = Engine.load(path, EngineParams(n_ctx=64))
    b = Engine.load(path, EngineParams(n_ctx=64, use_mmap=False))  # anonymous memory: the released pages are freed
    assert any(w.type_name in REPACKED for lw in b.weights.layers for w in lw.values())
    la, lb = (np.asarray(e.eval([3, 4, 5, 6], e.new_cache())) for e in (a, b))
    assert np.array_equal(la, lb)


def test_moe_experts_are_repacked_expert_by_expert(tmp_path):
    path = _model(tmp_path, arch="qwen3moe")
    a = Engine.load(path, EngineParams(n_ctx=64))
    b = Engine.load(path, EngineParams(n_ctx=64, repack=False))
    experts = [(k, w) for k, w in b.weights.layers[0].items() if w.raw.ndim == 3 and w.type_name in LAYOUTS]
    assert experts
    for key, wb in experts:
        wa = a.weights.layers[0][key]
        assert wa.type_name == LAYOUTS[wb.type_name][0] and wa.raw.shape[0] == wb.raw.shape[0]
        for e in range(wb.raw.shape[0]):
            assert np.array_equal(wa.expert(e).raw, LAYOUTS[wb.type_name][2](np.asarray(wb.raw[e])))
    ca, cb = a.new_cache(), b.new_cache()
    for tokens in ([3, 4, 5, 6, 7], [8], [9]):
        la, lb = np.asarray(a.eval(tokens, ca))[-1], np.asarray(b.eval(tokens, cb))[-1]
        assert la.argmax() == lb.argmax() and np.abs(la - lb).max() < 1e-3 * np.abs(lb).max()
