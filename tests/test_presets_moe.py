"""The gpt-oss-20b/120b and GLM-4.5-Air presets of the synthetic models: planned (dry run, nothing written) with
the real models' tensor counts, shapes, parameter counts and metadata, under the MXFP4_MOE, MXFP4 and IQ4_XS mixes;
and tiny models of both architectures written and read back as llama.cpp's hparams."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from gguf_io import ModelConfig, open_gguf
from hybrid.tools.synth.model import make_model, plan_model

# (arch, preset, tensors, parameters in billions as the model cards count them: 20.9, 116.8, 106 without MTP)
PRESETS = [("gpt-oss", "gpt-oss-20b", 3 + 24 * 19, 20.91), ("gpt-oss", "gpt-oss-120b", 3 + 36 * 19, 116.83),
           ("glm4moe", "glm-4.5-air", 3 + 12 + 45 * 17, 106.85)]


def _plan(arch, preset, mix):
    p = plan_model(arch, preset, mix)
    return p, {t.name: t for t in p.tensors}, {k: v for k, v, _ in p.metadata}


@pytest.mark.parametrize("arch, preset, n_tensors, params_b", PRESETS)
def test_preset_counts(arch, preset, n_tensors, params_b):
    p, _, _ = _plan(arch, preset, "MXFP4_MOE")
    assert len(p.tensors) == n_tensors
    assert sum(int(np.prod(t.ne)) for t in p.tensors) / 1e9 == pytest.approx(params_b, abs=0.01)


def test_gpt_oss_shapes_and_metadata():
    for preset, n_layer, n_expert in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        p, t, md = _plan("gpt-oss", preset, "MXFP4_MOE")
        last = f"blk.{n_layer - 1}."
        assert t[last + "attn_q.weight"].ne == (2880, 64 * 64) and t[last + "attn_k.weight"].ne == (2880, 8 * 64)
        assert t[last + "attn_output.weight"].ne == (4096, 2880) and t[last + "attn_sinks.weight"].ne == (64,)
        assert t[last + "ffn_gate_inp.weight"].ne == (2880, n_expert)
        assert t[last + "ffn_gate_inp.bias"].ne == (n_expert,)
        assert t[last + "ffn_up_exps.weight"].ne == (2880, 2880, n_expert)
        assert t[last + "ffn_down_exps.bias"].ne == (2880, n_expert)
        assert t["output.weight"].ne == (2880, 201088) and t["token_embd.weight"].ne == (2880, 201088)
        assert (md["gpt-oss.block_count"], md["gpt-oss.expert_count"], md["gpt-oss.expert_used_count"]) == (
            n_layer, n_expert, 4)
        assert (md["gpt-oss.attention.sliding_window"], md["gpt-oss.rope.scaling.type"], md["general.file_type"]) == (
            128, "yarn", 38)


def test_glm_4_5_air_shapes_and_metadata():
    p, t, md = _plan("glm4moe", "glm-4.5-air", "MXFP4_MOE")
    assert t["blk.0.ffn_gate.weight"].ne == (4096, 10944) and "blk.0.ffn_gate_exps.weight" not in t
    assert t["blk.1.attn_q.weight"].ne == (4096, 96 * 128) and t["blk.1.attn_v.bias"].ne == (8 * 128,)
    assert "blk.1.attn_q_norm.weight" not in t  # GLM-4.5-Air: use_qk_norm false
    assert t["blk.45.ffn_gate_exps.weight"].ne == (4096, 1408, 128)
    assert t["blk.45.ffn_down_exps.weight"].ne == (1408, 4096, 128)
    assert t["blk.45.ffn_down_shexp.weight"].ne == (1408, 4096) and t["blk.45.exp_probs_b.bias"].ne == (128,)
    assert "blk.46.attn_norm.weight" not in t and t["output.weight"].ne == (4096, 151552)
    assert (md["glm4moe.leading_dense_block_count"], md["glm4moe.expert_shared_count"],
            md["glm4moe.rope.dimension_count"], md["glm4moe.expert_gating_func"]) == (1, 1, 64, 2)


@pytest.mark.parametrize("arch, preset", [(a, p) for a, p, *_ in PRESETS])
def test_mixes(arch, preset):
    """MXFP4_MOE: experts MXFP4, other matrices Q8_0; one type: rows that are not whole blocks of it take llama.cpp's
    fallback (IQ4_XS's 256-blocks do not divide 2880 or 1408: IQ4_NL); biases, norms and router F32 always."""
    for mix in ("MXFP4_MOE", "MXFP4", "IQ4_XS"):
        p, t, _ = _plan(arch, preset, mix)
        for e in p.tensors:
            if len(e.ne) == 1 or e.name.endswith(".bias") or "ffn_gate_inp" in e.name:
                assert e.type_name == "F32", (mix, e.name)
            elif mix == "MXFP4_MOE":
                assert e.type_name == ("MXFP4" if "_exps." in e.name else "Q8_0"), e.name
            elif mix == "MXFP4":
                assert e.type_name == "MXFP4", e.name
            else:
                assert e.type_name == ("IQ4_XS" if e.ne[0] % 256 == 0 else "IQ4_NL"), e.name
        assert p.layout.file_size > 0


def test_iq4_xs_fallback_counts():
    types = Counter(e.type_name for e in plan_model("gpt-oss", "gpt-oss-20b", "IQ4_XS").tensors)
    assert types == {"F32": 289, "IQ4_NL": 146, "IQ4_XS": 24}  # only attn_output has 4096-wide rows


@pytest.mark.parametrize("arch", ["gpt-oss", "glm4moe"])
def test_tiny_moe_models_read_back(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    plan = make_model(path, arch, "tiny", "MXFP4_MOE", seed=2, n_layer=3, n_swa=16)
    assert path.stat().st_size == plan.layout.file_size
    with open_gguf(path) as f:
        cfg = ModelConfig.from_gguf(f)
        assert list(f.tensors) == [t.name for t in plan.tensors]
    assert (cfg.n_layer, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (3, 8, 2, 128)
    if arch == "gpt-oss":
        assert cfg.n_swa == 16 and cfg.swa_layers == (True, False, True) and cfg.yarn_ext_factor == 1.0
        assert not cfg.tied_output
    else:
        assert (cfg.n_layer_dense_lead, cfg.n_expert_shared, cfg.n_rot, cfg.expert_gating_func) == (1, 1, 32, "sigmoid")
        assert cfg.expert_weights_norm and cfg.n_ff == 512
