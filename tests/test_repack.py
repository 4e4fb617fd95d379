"""Q4_K rows interleaved by 8 (kernels_cpu.q4_k_x8, hybrid/repack.py): the repacked matmul against float64
references and against the plain Q4_K kernels, the layout's guards, what the loader repacks and what it leaves,
the released pages, and the stale Numba cache check of kernels_cpu."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.repack import repack_weights
from hybrid.synth import make_model
from kernels_cpu import drop_stale_cache, q4_k_x8
from kernels_cpu.matmul import GEMM_MIN_TOKENS, REPACKED, matmul, matmuls
from test_kernels_cpu_matmul import NMSE_TOL_SAME_ACT, converted_activations, dequantize64, random_weight


def nmse(a, ref):
    return float(np.mean((np.asarray(a, np.float64) - ref) ** 2) / max(np.mean(ref ** 2), 1e-30))


# (n_out, n_blocks, n_tok): one group, groups not filling a 16-row block, a batch through the GEMM
@pytest.mark.parametrize("n_out, nb, n_tok", [(8, 1, 1), (24, 3, 1), (136, 2, 5), (64, 4, GEMM_MIN_TOKENS + 3)])
def test_x8_matmul_matches_float64_and_plain_q4_k(n_out, nb, n_tok):
    rng = np.random.default_rng(n_out + nb)
    w = random_weight("Q4_K", n_out, 256 * nb, rng)
    x = rng.standard_normal((n_tok, 256 * nb)).astype(np.float32)
    rp = q4_k_x8.repack(w)
    assert rp.shape == (n_out, nb * 148)
    y = matmul(rp, "Q4_K_X8", x)
    ref = converted_activations(x, "Q4_K") @ dequantize64(w, "Q4_K").T
    assert nmse(y, ref) < NMSE_TOL_SAME_ACT
    plain = matmul(w, "Q4_K", x)
    if n_tok >= GEMM_MIN_TOKENS:  # rows decoded to the same floats, the same GEMM
        assert np.array_equal(y, plain)
    else:  # the same exact integer sums per super-block, summed in another float order
        assert np.allclose(y, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


def test_x8_decodes_rows_as_ggml():
    rng = np.random.default_rng(3)
    w = random_weight("Q4_K", 16, 512, rng)
    rp = q4_k_x8.repack(w).reshape(-1)
    ref = dequantize64(w, "Q4_K")
    out = np.empty(512, dtype=np.float32)
    for r in range(16):
        q4_k_x8.decode_row_f32(rp, r * 2 * 148, 2, out, 0)
        assert np.allclose(out, ref[r], rtol=1e-6, atol=1e-7)


def test_x8_in_a_fused_triple_with_other_k_types():
    rng = np.random.default_rng(4)
    q4, q6 = random_weight("Q4_K", 32, 512, rng), random_weight("Q6_K", 16, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    ys = matmuls([(q4_k_x8.repack(q4), "Q4_K_X8"), (q6, "Q6_K"), (q4, "Q4_K")], x)
    assert np.array_equal(ys[1], matmul(q6, "Q6_K", x))
    assert np.allclose(ys[0], ys[2], rtol=1e-5, atol=1e-5 * np.abs(ys[2]).max())


def test_x8_guards():
    rng = np.random.default_rng(5)
    assert REPACKED["Q4_K_X8"].row_group == 8
    assert not q4_k_x8.repackable((12, 256)) and q4_k_x8.repackable((16, 512))
    with pytest.raises(ValueError, match="8-row groups"):
        q4_k_x8.repack(random_weight("Q4_K", 12, 256, rng))
    with pytest.raises(ValueError, match="groups of 8 rows"):
        matmul(np.zeros((12, 148), dtype=np.uint8), "Q4_K_X8", np.zeros(256, dtype=np.float32))


def _model(tmp_path, arch="llama"):
    path = tmp_path / f"{arch}.gguf"
    make_model(path, arch, "tiny", "Q4_K_M", seed=7, n_layer=2)
    return path


def test_loader_repacks_cpu_q4_k_matrices_and_results_agree(tmp_path):
    path = _model(tmp_path)
    notes: list[str] = []
    a = Engine.load(path, EngineParams(n_ctx=64), progress=notes.append)
    b = Engine.load(path, EngineParams(n_ctx=64, repack=False))
    n = 0
    for la, lb in zip(a.weights.layers, b.weights.layers):
        for key, wb in lb.items():
            wa = la[key]
            if wb.type_name == "Q4_K" and wb.raw.ndim == 2:
                assert wa.type_name == "Q4_K_X8" and wa.shape == wb.shape
                assert np.array_equal(wa.raw, q4_k_x8.repack(np.asarray(wb.raw)))
                n += 1
            else:
                assert wa.type_name == wb.type_name
    assert n > 0 and any(f"repack: {n} Q4_K matrices" in m for m in notes)
    assert a.weights.token_embd.type_name == b.weights.token_embd.type_name  # the embedding rows stay readable
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
    assert done.n_matrices == sum(v.type_name == "Q4_K_X8" for v in w.layers[0].values()) > 0
    assert {k: v.type_name for k, v in w.layers[1].items()} == before
    assert done.n_bytes == sum(v.nbytes for v in w.layers[0].values() if v.type_name == "Q4_K_X8")
    assert 0 < done.released_bytes <= sum(v.nbytes for v in w.layers[0].values() if v.type_name == "Q4_K_X8")
    assert w.output is w.token_embd or w.output.type_name != "Q4_K"


def test_no_repack_when_op_offload_streams_the_weights(tmp_path, monkeypatch):
    import hybrid.engine as engine_mod

    class FakeOffload:
        def close(self):
            pass

    monkeypatch.setattr(engine_mod, "make_op_offload", lambda *a, **k: FakeOffload())
    eng = Engine.load(_model(tmp_path), EngineParams(n_ctx=64, op_offload=True))
    assert all(w.type_name != "Q4_K_X8" for lw in eng.weights.layers for w in lw.values())


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
