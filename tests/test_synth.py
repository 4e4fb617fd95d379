"""Synthetic GGUF models (hybrid.synth): readable, the requested shape, sane weights, deterministic, right sizes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from gguf_io import QUANTS, ModelConfig, open_gguf
from hybrid.tools.synth.model import make_model, plan_model, planned_size, resolve_shape
from hybrid.tools.synth.blocks import SUPPORTED_TYPES, random_tensor
from hybrid.tools.synth.qtypes import use_more_bits
from gguf_io.writer import TensorEntry, layout, write_gguf

ARCHS = ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"]
GiB = 2**30


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_weights(path: Path, plan) -> None:
    """Every tensor dequantizes to finite values with the planned mean and std."""
    draws = dict(zip((t.name for t in plan.tensors), plan.draws))
    with open_gguf(path) as f:
        assert list(f.tensors) == [t.name for t in plan.tensors]
        for name, ti in f.tensors.items():
            raw = np.asarray(f.tensor_data(name)).view(np.uint8).reshape(-1)
            y = QUANTS[ti.type_name].dequantize(raw)
            assert np.isfinite(y).all(), name
            d = draws[name]
            tol = 0.15 if y.size >= 4096 else 0.4  # small 1-D tensors: the sample std itself varies
            assert abs(y.std() / d.std - 1) < tol, (name, ti.type_name, y.std(), d.std)
            assert abs(y.mean() - d.mean) < 0.1 * d.std + 4 * d.std / np.sqrt(y.size), (name, y.mean(), d.mean)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_of_each_arch(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    plan = make_model(path, arch, "tiny", seed=3, n_layer=3, head_dim=128 if arch == "qwen3" else None)
    s = plan.shape
    assert path.stat().st_size == plan.layout.file_size
    with open_gguf(path) as f:
        cfg = ModelConfig.from_gguf(f)
        assert f.alignment == 32 and f.architecture == arch
        assert f.tensors["token_embd.weight"].ne == (s.n_embd, s.n_vocab)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_ff, cfg.n_vocab) == (3, 256, 4, 2, 512, 1024)
    assert cfg.n_embd_head_k == cfg.n_embd_head_v == (128 if arch == "qwen3" else 64)
    assert cfg.tied_output == (arch == "gemma3")
    if arch == "qwen3moe":
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (8, 2, 128)
    if arch == "gemma3":
        assert cfg.n_swa == 32
    _check_weights(path, plan)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_uniform_types(tmp_path, qtype):
    path = tmp_path / "m.gguf"
    plan = make_model(path, "llama", "tiny", qtype, seed=1, n_layer=1, n_vocab=300, n_ff=256)
    with open_gguf(path) as f:
        got = {t.type_name for t in f.tensors.values() if len(t.ne) > 1}
    assert got == {qtype}
    _check_weights(path, plan)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "Q2_K", "Q3_K", "Q5_K", "MXFP4"])
def test_blocks_std_and_zero_mean(qtype):
    for std in (0.005, 0.02, 0.06):
        y = QUANTS[qtype].dequantize(random_tensor(7, "w", qtype, 256 * 512, std))
        assert np.isfinite(y).all()
        assert abs(y.std() / std - 1) < 0.05 and abs(y.mean()) < 0.02 * std, (std, y.std(), y.mean())


def test_mxfp4_moe_mix(tmp_path):
    # llama.cpp's MXFP4_MOE: expert tensors MXFP4, every other matrix Q8_0, 1-D tensors and the router F32
    path = tmp_path / "m.gguf"
    plan = make_model(path, "qwen3moe", "tiny", "MXFP4_MOE", seed=1, n_layer=1, n_vocab=300)
    with open_gguf(path) as f:
        types = {t.name: t.type_name for t in f.tensors.values()}
    assert {n for n, t in types.items() if t == "MXFP4"} == {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                                                             "blk.0.ffn_down_exps.weight"}
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == "F32"
    _check_weights(path, plan)


def test_deterministic(tmp_path):
    a, b, c, d = (tmp_path / f"{x}.gguf" for x in "abcd")
    make_model(a, "qwen2", "tiny", seed=5, threads=1)
    make_model(b, "qwen2", "tiny", seed=5, threads=3)
    make_model(c, "qwen2", "tiny", seed=6)
    make_model(d, "qwen2", "tiny", "Q8_0", seed=5)
    assert _sha256(a) == _sha256(b)
    assert _sha256(a) != _sha256(c)
    with open_gguf(a) as fa, open_gguf(d) as fd:  # the norms are F32 either way: same draws
        assert np.array_equal(fa.tensor_data("blk.0.attn_norm.weight"), fd.tensor_data("blk.0.attn_norm.weight"))


def test_preset_sizes():
    assert 4.5 * GiB <= planned_size("llama-8b") <= 4.8 * GiB
    assert 18 * GiB <= planned_size("qwen-32b", arch="qwen2") <= 20 * GiB
    assert 0.70 * GiB <= planned_size("llama-1b") <= 0.80 * GiB  # Llama-3.2-1B Q4_K_M: 808 MB
    assert 39 * GiB <= planned_size("llama-70b") <= 40.5 * GiB  # Llama-3-70B Q4_K_M: 42.5 GB


def test_q4_k_m_rules():
    plan = plan_model("llama", "llama-8b")
    types = {t.name: t.type_name for t in plan.tensors}
    more = [il for il in range(32) if use_more_bits(il, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for il in range(32):
        want = "Q6_K" if il in more else "Q4_K"
        assert types[f"blk.{il}.attn_v.weight"] == types[f"blk.{il}.ffn_down.weight"] == want
        assert types[f"blk.{il}.attn_q.weight"] == types[f"blk.{il}.ffn_up.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert plan_model("llama", "llama-1b").tensors[0].type_name == "Q6_K"  # tied token_embd
    types70 = {t.name: t.type_name for t in plan_model("llama", "llama-70b").tensors}
    assert types70["blk.20.attn_v.weight"] == "Q5_K" and types70["blk.21.attn_v.weight"] == "Q6_K"


def test_row_fallbacks():
    # rows not whole 256-blocks fall back as llama-quantize does; not whole 32-blocks -> F16
    types = {t.name: t.type_name for t in plan_model("llama", "tiny", n_embd=288, n_head=4, n_head_kv=2).tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q4_K"  # n_ff 512 is whole blocks
    types = {t.name: t.type_name for t in plan_model("llama", "tiny", n_embd=80, n_head=2, n_head_kv=1).tensors}
    assert types["blk.0.attn_q.weight"] == "F16"


def test_matches_llama_quantize_fixtures(fixtures_dir):
    """Same tensor table (names, ne, types) and hparam keys as the llama.cpp-quantized Q4_K_M fixtures."""
    manifest = json.loads((fixtures_dir / "arch" / "manifest.json").read_text())
    vocab = fixtures_dir / "vocab" / "ggml-vocab-llama-spm.gguf"
    extra = {"qwen3": {"head_dim": 128}, "qwen3moe": {"n_ff": 768, "n_ff_exp": 128}}
    for arch in ["llama", "qwen2", "qwen3", "qwen3moe"]:
        plan = plan_model(arch, "tiny", vocab_gguf=vocab, n_layer=4, tied=True, **extra.get(arch, {}))
        ours = {t.name: (t.ne, t.type_name) for t in plan.tensors}
        with open_gguf(fixtures_dir / "arch" / f"{arch}-q4_k_m.gguf") as f:
            assert ours == {n: (t.ne, t.type_name) for n, t in f.tensors.items()}, arch
        keys = {k for k, _, _ in plan.metadata}
        assert set(manifest[f"{arch}-q4_k_m.gguf"]["hparams"]) <= keys, arch
        assert plan.shape.n_vocab == 32000


def test_vocab_copy_and_padding(tmp_path, fixtures_dir):
    src = fixtures_dir / "vocab" / "ggml-vocab-llama-spm.gguf"
    path = tmp_path / "v.gguf"
    make_model(path, "llama", "tiny", vocab_gguf=src, n_vocab=32256, n_layer=1)
    with open_gguf(src) as v, open_gguf(path) as f:
        tok_keys = [k for k in v.metadata if k.startswith("tokenizer.")]
        for k in tok_keys:
            assert f.metadata_types[k] == v.metadata_types[k], k
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert tokens[:32000] == v.metadata["tokenizer.ggml.tokens"] and tokens[-1] == "[PAD32255]"
        assert f.metadata["tokenizer.ggml.token_type"][-1] == 5
        assert np.array_equal(f.metadata["tokenizer.ggml.scores"][:32000], v.metadata["tokenizer.ggml.scores"])
        assert ModelConfig.from_gguf(f).n_vocab == 32256 == f.tensors["token_embd.weight"].ne[1]


def test_synthetic_vocab_tokenizes(tmp_path):
    tok_mod = pytest.importorskip("hybrid.text.tokenizer")
    path = tmp_path / "m.gguf"
    make_model(path, "llama", "tiny", n_layer=1)
    with open_gguf(path) as f:
        tok = tok_mod.Tokenizer.from_metadata(f.metadata)
    text = "Hello world, a test: \u00fcml\u00e4ut \u4e2d\u6587!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1 and tok.eos_id == 2 and tok.n_vocab == 1024
    assert max(ids) < 1024 and tok.decode(ids[1:]).strip() == text


def test_writer_metadata_round_trip(tmp_path):
    from gguf_io.metadata import ARRAY, BOOL, F32, F64, I8, I16, I32, I64, STRING, U8, U16, U32, U64

    md = [("general.architecture", "llama", STRING), ("a.u8", 200, U8), ("a.i8", -100, I8), ("a.u16", 60000, U16),
          ("a.i16", -30000, I16), ("a.u32", 4_000_000_000, U32), ("a.i32", -5, I32), ("a.f32", 0.5, F32),
          ("a.bool", True, BOOL), ("a.u64", 2**63 + 5, U64), ("a.i64", -(2**62), I64), ("a.f64", 1e-300, F64),
          ("a.strs", ["x", "", "\u00fc\u4e2d"], (ARRAY, STRING)),
          ("a.f32s", np.array([1.5, -2], np.float32), (ARRAY, F32)),
          ("a.bools", np.array([True, False]), (ARRAY, BOOL)), ("a.empty", np.zeros(0, np.int32), (ARRAY, I32))]
    t = [TensorEntry("w", (32, 3), "Q8_0"), TensorEntry("v", (5,), "F32")]
    data = {"w": random_tensor(0, "w", "Q8_0", 96, 0.1), "v": np.arange(5, dtype=np.float32)}
    path = tmp_path / "w.gguf"
    write_gguf(path, layout(md, t), t, lambda e: [data[e.name]])
    with open_gguf(path) as f:
        for k, v, vt in md:
            got = f.metadata[k]
            assert f.metadata_types[k] == vt, k
            assert (np.array_equal(got, v) if isinstance(v, np.ndarray) else got == v), k
        assert f.tensor_data("w").tobytes() == data["w"].tobytes()
        assert np.array_equal(f.tensor_data("v"), data["v"])


def test_resolve_shape_errors():
    with pytest.raises(ValueError, match="preset"):
        resolve_shape("llama", "llama-9b")
    with pytest.raises(ValueError, match="architecture"):
        resolve_shape("mamba", "tiny")
    with pytest.raises(ValueError, match="multiple"):
        resolve_shape("llama", "tiny", n_head_kv=3)
    assert resolve_shape("qwen3moe", "llama-8b").n_ff_exp == 14336 // 4


def test_writer_leaves_no_partial_file(tmp_path):
    t = [TensorEntry("w", (32,), "F32")]
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="expected 128"):
        write_gguf(path, layout([], t), t, lambda e: [np.zeros(3, np.float32)])
    assert list(tmp_path.iterdir()) == []
