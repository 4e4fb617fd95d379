"""ModelConfig.from_gguf: the fixture models against manifest.json, Gemma 3 270M, and synthetic edge cases."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gguf_io import GGUFFormatError, ModelConfig, UnsupportedArchitecture, open_gguf
from gguf_factory import VT, Tensor, Typed, tiny_model, write_gguf

ARCH_DIR = Path(__file__).resolve().parent / "fixtures" / "arch"
DEMO = Path.home() / ".cache" / "hybrid" / "gemma-3-270m-q4_k_m.gguf"
# manifest hparam key (without the "{arch}." prefix) -> ModelConfig field
FIELDS = {
    "context_length": "n_ctx_train", "embedding_length": "n_embd", "block_count": "n_layer",
    "feed_forward_length": "n_ff", "attention.head_count": "n_head", "attention.head_count_kv": "n_head_kv",
    "rope.dimension_count": "n_rot", "vocab_size": "n_vocab", "rope.freq_base": "rope_freq_base",
    "attention.layer_norm_rms_epsilon": "f_norm_rms_eps", "attention.key_length": "n_embd_head_k",
    "attention.value_length": "n_embd_head_v", "expert_count": "n_expert", "expert_used_count": "n_expert_used",
    "expert_feed_forward_length": "n_ff_exp", "general.file_type": "file_type",
    "leading_dense_block_count": "n_layer_dense_lead", "expert_shared_count": "n_expert_shared",
    "expert_weights_scale": "expert_weights_scale", "expert_weights_norm": "expert_weights_norm",
    "expert_group_count": "n_expert_groups", "expert_group_used_count": "n_group_used",
    "attention.q_lora_rank": "n_lora_q", "attention.kv_lora_rank": "n_lora_kv",
    "attention.key_length_mla": "n_embd_head_k_mla", "attention.value_length_mla": "n_embd_head_v_mla",
    "rope.scaling.original_context_length": "n_ctx_orig_yarn", "attention.sliding_window": "n_swa",
}
# keys whose value the config turns into something else (checked on their own below)
DERIVED = {"expert_gating_func", "rope.scaling.type", "rope.scaling.factor", "rope.scaling.yarn_log_multiplier"}
SECOND_ROUND = ("glm4moe", "deepseek2", "gpt-oss")


def _manifest() -> dict:
    """The manifest's entries for the GGUFs tests/fixtures/arch holds (it lists more than the tests need)."""
    path = ARCH_DIR / "manifest.json"
    entries = json.loads(path.read_text()) if path.is_file() else {}
    return {name: entry for name, entry in entries.items() if (ARCH_DIR / name).is_file()}


@pytest.mark.parametrize("name", sorted(_manifest()) or ["(fixtures absent)"])
def test_fixture_config_matches_manifest(name):
    entry = _manifest().get(name)
    if entry is None:
        pytest.skip(f"no manifest.json with a present GGUF under {ARCH_DIR}")
    arch = entry["arch"]
    c = ModelConfig.from_gguf(open_gguf(ARCH_DIR / name))
    assert c.arch == arch
    for key, expected in entry["hparams"].items():
        if key.startswith("synthetic.") or key.removeprefix(f"{arch}.") in DERIVED:
            continue
        field = FIELDS[key.removeprefix(f"{arch}.")]
        assert getattr(c, field) == expected, (key, field)
    if arch in SECOND_ROUND:
        _second_round(c, arch)
        return
    # README: 32000 tokens, tied embeddings, no sliding window, no RoPE scaling
    assert (c.n_vocab, c.tied_output, c.n_swa, c.rope_freq_scale) == (32000, True, 0, 1.0)
    assert c.swa_layers == (False,) * c.n_layer and c.rope_freq_base_swa == c.rope_freq_base
    assert c.rope_type == ("norm" if arch == "llama" else "neox")
    head = 128 if arch == "qwen3" else 64
    assert (c.n_embd_head_k, c.n_embd_head_v, c.n_rot) == (head, head, head)
    assert c.f_attention_scale == pytest.approx(1 / math.sqrt(head))
    assert c.n_gqa == 2 and c.n_embd_k_gqa == 2 * head
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (None, None)


def _second_round(c: ModelConfig, arch: str) -> None:
    """The fixture README's glm4moe, deepseek2 and gpt-oss parameters, the derived ones included."""
    if arch == "gpt-oss":
        _gpt_oss(c)
        return
    assert (c.n_vocab, c.tied_output, c.n_swa, c.n_layer, c.n_layer_nextn) == (32000, True, 0, 4, 0)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_expert_shared, c.n_layer_dense_lead) == (8, 2, 32, 1, 1)
    assert (c.expert_gating_func, c.expert_weights_norm, c.expert_weights_scale) == ("sigmoid", True, 2.5)
    if arch == "glm4moe":
        assert (c.rope_type, c.n_rot, c.n_embd_head_k, c.rope_freq_scale, c.rope_yarn) == ("neox", 32, 64, 1.0, None)
        assert c.f_attention_scale == 1 / 8 and (c.n_expert_groups, c.n_lora_kv) == (0, 0)
        return
    assert (c.rope_type, c.n_rot, c.n_head_kv, c.n_embd_head_k, c.n_embd_head_v) == ("norm", 32, 1, 96, 64)
    assert (c.n_expert_groups, c.n_group_used, c.n_lora_q, c.n_lora_kv) == (2, 1, 64, 64)
    assert c.rope_freq_scale == 1 / 40 and c.rope_scaling_type == "yarn"
    ext, attn, lo, hi = c.rope_yarn
    mscale = 1 + 0.1 * math.log(40)  # the rotation's factor is cancelled: attn_factor * mscale == 1
    assert (ext, lo, hi) == (1.0, 5.0, 12.0) and attn * mscale == pytest.approx(1, abs=1e-6)
    assert c.f_attention_scale == pytest.approx(mscale**2 / 8, rel=1e-6)  # the README's 0.23423


def test_gemma3_270m():
    if not DEMO.is_file():
        pytest.skip(f"demo model not found at {DEMO} (pip install -e '.[demo]')")
    c = ModelConfig.from_gguf(open_gguf(DEMO))
    assert (c.arch, c.name, c.n_vocab, c.n_ctx_train) == ("gemma3", "Gemma 3 270m", 262144, 32768)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_ff) == (18, 640, 4, 1, 2048)
    assert (c.n_embd_head_k, c.n_embd_head_v, c.n_rot) == (256, 256, 256)
    assert c.n_swa == 512
    # llama.cpp set_swa_pattern(6): layers 5, 11, 17 are global, the others sliding
    assert [il for il in range(18) if not c.swa_layers[il]] == [5, 11, 17]
    assert (c.rope_freq_base, c.rope_freq_base_swa, c.rope_type) == (1e6, 1e4, "neox")
    assert c.rope_base(0) == 1e4 and c.rope_base(5) == 1e6 and c.is_swa(4) and not c.is_swa(11)
    assert c.f_attention_scale == 1 / 16 and c.f_norm_rms_eps == pytest.approx(1e-6)
    assert c.tied_output and c.file_type == 15 and c.n_expert == 0


def _config(tmp_path, arch="llama", tensors=None, drop=(), **extra) -> ModelConfig:
    md, ts = tiny_model(arch, extra={k.replace("__", "."): v for k, v in extra.items()})
    for key in drop:
        del md[key]
    return ModelConfig.from_gguf(open_gguf(write_gguf(tmp_path / "m.gguf", md, ts if tensors is None else tensors)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
def test_tiny_models(tmp_path, arch):
    c = _config(tmp_path, arch)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_vocab) == (2, 64, 4, 2, 40)
    assert c.n_embd_head_k == 16 and c.rope_freq_scale == 1.0 and c.rope_scaling_type == "linear"
    assert (c.n_expert, c.n_ff_exp) == ((4, 32) if arch == "qwen3moe" else (0, 0))
    assert c.n_swa == (16 if arch == "gemma3" else 0)


def _gpt_oss(c: ModelConfig) -> None:
    """gpt-oss: untied output, SWA on the even layers (llama.cpp's default pattern 2), YaRN x32 on all 64 dims with
    the rotation's magnitude 1 + 0.1 ln 32 left in (attn_factor 1), softmax over the selected logits."""
    assert (c.n_vocab, c.tied_output, c.n_swa, c.swa_layers) == (32000, False, 32, (True, False, True, False))
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_expert_shared, c.n_layer_dense_lead) == (8, 4, 32, 0, 0)
    assert (c.expert_gating_func, c.expert_weights_norm, c.expert_weights_scale) == ("softmax_weight", False, 0.0)
    assert (c.rope_type, c.n_rot, c.n_head_kv, c.n_embd_head_k, c.f_attention_scale) == ("neox", 64, 1, 64, 1 / 8)
    assert c.rope_freq_scale == c.rope_freq_scale_swa == 1 / 32 and c.rope_freq_base_swa == c.rope_freq_base
    assert c.rope_yarn == (1.0, 1.0, 8.0, 18.0)


def test_unknown_architecture(tmp_path):
    supported = r"'mamba'.*deepseek2, gemma3, glm4moe, gpt-oss, llama, qwen2, qwen3, qwen3moe"
    with pytest.raises(UnsupportedArchitecture, match=supported):
        _config(tmp_path, "mamba")


def test_missing_architecture(tmp_path):
    md, ts = tiny_model("llama")
    del md["general.architecture"]
    with pytest.raises(GGUFFormatError, match="general.architecture"):
        ModelConfig.from_gguf(open_gguf(write_gguf(tmp_path / "m.gguf", md, ts)))


def test_missing_and_mistyped_keys(tmp_path):
    with pytest.raises(GGUFFormatError, match="missing metadata key 'llama.block_count'"):
        _config(tmp_path, drop=["llama.block_count"])
    with pytest.raises(GGUFFormatError, match="llama.embedding_length must be an integer, found str '64'"):
        _config(tmp_path, llama__embedding_length="64")
    with pytest.raises(GGUFFormatError, match=r"context_length must be an integer, found an array of 2000 int32$"):
        _config(tmp_path, llama__context_length=Typed(VT.ARRAY, list(range(2000)), VT.I32))
    with pytest.raises(GGUFFormatError, match="llama.attention.head_count must be >= 1, found 0"):
        _config(tmp_path, llama__attention__head_count=0)
    with pytest.raises(GGUFFormatError, match=r"head_count \(4\) must be a multiple of .*head_count_kv \(3\)"):
        _config(tmp_path, llama__attention__head_count_kv=3)
    with pytest.raises(GGUFFormatError, match="rope.freq_base must be a finite number"):
        _config(tmp_path, llama__rope__freq_base=float("nan"))
    with pytest.raises(GGUFFormatError, match="invalid n_rot 8 for llama: expected the head size 16"):
        _config(tmp_path, llama__rope__dimension_count=8)
    with pytest.raises(GGUFFormatError, match="qwen3moe needs expert_count"):
        _config(tmp_path, "qwen3moe", drop=["qwen3moe.expert_count", "qwen3moe.expert_used_count"])
    with pytest.raises(GGUFFormatError, match="sliding_window"):
        _config(tmp_path, "gemma3", drop=["gemma3.attention.sliding_window"])


def test_defaults_and_optional_keys(tmp_path):
    c = _config(tmp_path, drop=["llama.attention.head_count_kv", "llama.rope.freq_base"])
    assert c.n_head_kv == c.n_head == 4 and c.rope_freq_base == 10000.0
    c = _config(tmp_path, "qwen3", qwen3__attention__key_length=32, qwen3__attention__value_length=24)
    assert (c.n_embd_head_k, c.n_embd_head_v, c.n_rot) == (32, 24, 32)
    assert c.f_attention_scale == pytest.approx(1 / math.sqrt(32))
    c = _config(tmp_path, llama__rope__scaling__type="linear", llama__rope__scaling__factor=4.0)
    assert c.rope_freq_scale == 0.25
    c = _config(tmp_path, "gemma3", gemma3__attn_logit_softcapping=50.0, gemma3__final_logit_softcapping=30.0)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    c = _config(tmp_path, "qwen2", qwen2__rope__freq_base_swa=5000.0)
    assert c.rope_freq_base_swa == 5000.0


def test_per_layer_arrays(tmp_path):
    uniform = Typed(VT.ARRAY, [4, 4], VT.I32)
    assert _config(tmp_path, llama__attention__head_count=uniform).n_head == 4
    with pytest.raises(GGUFFormatError, match="per-layer values"):
        _config(tmp_path, llama__feed_forward_length=Typed(VT.ARRAY, [96, 128], VT.U32))


def test_n_vocab_sources(tmp_path):
    md, ts = tiny_model("llama", n_vocab=40)
    assert _config(tmp_path, llama__vocab_size=50).n_vocab == 50  # the {arch}.vocab_size key wins
    del md["tokenizer.ggml.tokens"]
    path = write_gguf(tmp_path / "nv.gguf", md, ts)
    assert ModelConfig.from_gguf(open_gguf(path)).n_vocab == 40  # token_embd rows
    path = write_gguf(tmp_path / "nv.gguf", md, [t for t in ts if t.name != "token_embd.weight"])
    with pytest.raises(GGUFFormatError, match="vocabulary size"):
        ModelConfig.from_gguf(open_gguf(path))


def test_tied_output_and_swa_pattern(tmp_path):
    md, ts = tiny_model("gemma3", n_layer=13, tied=False)
    c = ModelConfig.from_gguf(open_gguf(write_gguf(tmp_path / "g.gguf", md, ts)))
    assert not c.tied_output
    assert c.swa_layers == (True,) * 5 + (False,) + (True,) * 5 + (False,) + (True,)


def test_gemma3_27b_attention_scale(tmp_path):
    # llama.cpp: the 62-layer model scales queries by 1/sqrt(n_embd / n_head), not 1/sqrt(head_dim)
    md, _ = tiny_model("gemma3", n_layer=62, n_embd=96, n_head=2, n_head_kv=1, head_dim=32, vocab=False)
    ts = [Tensor("token_embd.weight", (96, 10), "F32")]
    c = ModelConfig.from_gguf(open_gguf(write_gguf(tmp_path / "g.gguf", md, ts)))
    assert c.f_attention_scale == pytest.approx(1 / math.sqrt(48)) and c.n_embd_head_k == 32
