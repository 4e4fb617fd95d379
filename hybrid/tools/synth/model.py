"""Synthetic GGUF models of the supported architectures but deepseek2, any size: tiny test models up to Llama-3-70B,
gpt-oss-120b and GLM-4.5-Air shapes.

Weights are random quantized blocks with sane scales (`synth.blocks`), written tensor by tensor (`gguf_io.writer`);
types follow llama.cpp's Q4_K_M rules (`synth.qtypes`) or one uniform type. Deterministic in the seed.

    make_model("m.gguf", "llama", "llama-8b", "Q4_K_M", seed=1, vocab_gguf=".../ggml-vocab-llama-bpe.gguf")
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from math import sqrt
from pathlib import Path
from typing import Callable

import numpy as np

from gguf_io.config import SUPPORTED_ARCHITECTURES
from gguf_io.metadata import BOOL, F32, STRING, U32

from hybrid.tools.synth.blocks import chunk_jobs, random_tensor
from hybrid.tools.synth.qtypes import tensor_type
from hybrid.tools.synth.vocab import synthetic_vocab, vocab_from_gguf
from gguf_io.writer import GGUFLayout, TensorEntry, layout, write_gguf


@dataclass(frozen=True)
class ModelShape:
    """Hyperparameters with llama.cpp's names. None fields take the architecture's default."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    head_dim: int | None = None  # None: n_embd // n_head
    n_expert: int = 0  # MoE archs (MOE_ARCHS): 0 means 8 experts, 2 used, n_ff_exp = n_ff // 4
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ctx_train: int = 4096
    tied: bool | None = None  # no output.weight (the LM head is token_embd); None: gemma3 tied, others untied
    n_swa: int = 512  # gemma3 and gpt-oss sliding window (gpt-oss: on the even layers)
    n_expert_shared: int | None = None  # glm4moe: shared experts (ffn_*_shexp, n_ff_exp wide each); None: 1
    n_layer_dense_lead: int | None = None  # glm4moe: the first layers' FFN is dense (n_ff wide); None: 1
    n_rot: int | None = None  # RoPE dims per head; None: the head (glm4moe: half of it, partial_rotary_factor 0.5)
    qk_norm: bool | None = None  # glm4moe: attn_q_norm/attn_k_norm (GLM-4.5 has them, 4.5-Air not); None: False
    rope_freq_base: float | None = None
    rms_eps: float | None = None
    # qwen3moe: a skewed router. Router row e (expert e) is scaled by (1 + rank)^-router_skew, ranks shuffled per
    # layer, the scales' mean square 1: the experts with the widest logits win the top-k most often, a Zipf-like
    # share of the tokens (0: every expert alike, as a random router; trained routers are skewed)
    router_skew: float = 0.0


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(2, 256, 4, 2, 512, 1024, n_swa=32),
    "llama-1b": ModelShape(16, 2048, 32, 8, 8192, 128256, n_ctx_train=131072, tied=True),  # Llama-3.2-1B
    "llama-3b": ModelShape(28, 3072, 24, 8, 8192, 128256, n_ctx_train=131072, tied=True),  # Llama-3.2-3B
    "llama-8b": ModelShape(32, 4096, 32, 8, 14336, 128256, n_ctx_train=8192),  # Llama-3-8B
    "qwen-32b": ModelShape(64, 5120, 40, 8, 27648, 152064, n_ctx_train=32768),  # Qwen2.5-32B
    "llama-70b": ModelShape(80, 8192, 64, 8, 28672, 128256, n_ctx_train=8192),  # Llama-3-70B
    "qwen3moe-30b": ModelShape(48, 2048, 32, 4, 6144, 151936, head_dim=128, n_expert=128, n_expert_used=8,
                               n_ff_exp=768, n_ctx_train=40960),  # Qwen3-30B-A3B
    # openai/gpt-oss-20b and -120b config.json (num_hidden_layers, hidden_size, num_attention_heads 64,
    # num_key_value_heads 8, head_dim 64, num_local_experts, num_experts_per_tok 4, intermediate_size 2880,
    # sliding_window 128, vocab_size 201088, rope_theta 150000, YaRN x32 from 4096, max_position_embeddings
    # 131072), as llama.cpp's convert_hf_to_gguf writes them (feed_forward_length = expert width = 2880)
    "gpt-oss-20b": ModelShape(24, 2880, 64, 8, 2880, 201088, head_dim=64, n_expert=32, n_expert_used=4,
                              n_ff_exp=2880, n_ctx_train=131072, n_swa=128, rope_freq_base=150000.0),
    "gpt-oss-120b": ModelShape(36, 2880, 64, 8, 2880, 201088, head_dim=64, n_expert=128, n_expert_used=4,
                               n_ff_exp=2880, n_ctx_train=131072, n_swa=128, rope_freq_base=150000.0),
    # zai-org/GLM-4.5-Air config.json: hidden_size 4096, num_hidden_layers 46, 96 heads of head_dim 128, 8 KV heads,
    # intermediate_size 10944 (first_k_dense_replace 1 dense layer), n_routed_experts 128, num_experts_per_tok 8,
    # n_shared_experts 1, moe_intermediate_size 1408, vocab_size 151552, partial_rotary_factor 0.5, use_qk_norm
    # false, attention_bias true, routed_scaling_factor 1.0, norm_topk_prob true, rope_theta 1e6. The real GGUF
    # also holds the NextN/MTP block (block_count 47, nextn_predict_layers 1), which llama.cpp never runs: left out.
    "glm-4.5-air": ModelShape(46, 4096, 96, 8, 10944, 151552, head_dim=128, n_expert=128, n_expert_used=8,
                              n_ff_exp=1408, n_ctx_train=131072, n_expert_shared=1, n_layer_dense_lead=1),
}
MOE_ARCHS = ("qwen3moe", "glm4moe", "gpt-oss")
_ROPE_BASE = {"llama": 500000.0, "qwen2": 1e6, "qwen3": 1e6, "qwen3moe": 1e6, "gemma3": 1e6, "glm4moe": 1e6,
              "gpt-oss": 150000.0}
_RMS_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "qwen3moe": 1e-6, "gemma3": 1e-6, "glm4moe": 1e-5,
            "gpt-oss": 1e-5}
# gpt-oss: rope_scaling {"rope_type": "yarn", "factor": 32, "original_max_position_embeddings": 4096}
_GPT_OSS_YARN = (32.0, 4096)

# Weight draws, as the fixtures' generator (tests/fixtures/arch/README.md, "Weight draws") at n_embd 256: matrices N(0, std)
# with std scaled by sqrt(256 / n_in) for wider inputs (activations stay O(1) at any size); 1-D tensors N(mean, sd).
_MATRIX_STD = {"token_embd": 0.05, "attn_q": 0.08, "attn_k": 0.08, "attn_v": 0.06, "attn_output": 0.06,
               "ffn_gate": 0.06, "ffn_up": 0.06, "ffn_down": 0.04, "output": 0.06, "ffn_gate_inp": 0.10,
               "ffn_gate_exps": 0.06, "ffn_up_exps": 0.06, "ffn_down_exps": 0.05, "ffn_gate_shexp": 0.06,
               "ffn_up_shexp": 0.06, "ffn_down_shexp": 0.05}
_VECTOR_DRAW = {"attn_norm": (1.0, 0.1), "ffn_norm": (1.0, 0.1), "post_attention_norm": (1.0, 0.1),
                "post_ffw_norm": (1.0, 0.1), "attn_q_norm": (1.3, 0.15), "attn_k_norm": (1.3, 0.15),
                "output_norm": (4.0, 0.3), "attn_q.bias": (0.0, 0.2), "attn_k.bias": (0.0, 0.3),
                "attn_v.bias": (0.0, 0.1), "attn_output.bias": (0.0, 0.05), "attn_sinks": (0.0, 1.0),
                "ffn_gate_inp.bias": (0.0, 0.1), "exp_probs_b": (0.0, 0.01), "ffn_gate_exps.bias": (0.0, 0.05),
                "ffn_up_exps.bias": (0.0, 0.05), "ffn_down_exps.bias": (0.0, 0.02)}


def matrix_std(kind: str, n_in: int) -> float:
    """The std of the weights of a matrix `kind` ("attn_q", ...) with `n_in` inputs (ne[0])."""
    return _MATRIX_STD[kind] * sqrt(256 / max(n_in, 256))


def resolve_shape(arch: str, shape: str | ModelShape, **overrides) -> ModelShape:
    """A preset name or a ModelShape, with `overrides` (ModelShape fields; None values ignored) and the
    architecture's defaults filled in."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if isinstance(shape, str):
        if shape not in PRESETS:
            raise ValueError(f"unknown preset {shape!r}; presets: {', '.join(PRESETS)}")
        shape = PRESETS[shape]
    known = {f.name for f in fields(ModelShape)}
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"unknown shape fields {sorted(bad)}; fields: {sorted(known)}")
    s = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    if arch not in _ROPE_BASE:
        raise ValueError(f"architecture {arch!r} has no synthetic layout; synthetic: {', '.join(_ROPE_BASE)}")
    glm = arch == "glm4moe"
    hd = s.head_dim or s.n_embd // s.n_head
    s = replace(s, head_dim=hd, tied=(arch == "gemma3") if s.tied is None else s.tied,
                rope_freq_base=s.rope_freq_base or _ROPE_BASE[arch], rms_eps=s.rms_eps or _RMS_EPS[arch],
                n_rot=s.n_rot or (hd // 2 if glm else hd),
                qk_norm=arch in ("qwen3", "qwen3moe", "gemma3") or (glm and bool(s.qk_norm)),
                n_expert_shared=(1 if s.n_expert_shared is None else s.n_expert_shared) if glm else 0,
                n_layer_dense_lead=(min(1, s.n_layer - 1) if s.n_layer_dense_lead is None else s.n_layer_dense_lead)
                if glm else 0)
    if arch in MOE_ARCHS and s.n_expert == 0:
        s = replace(s, n_expert=8, n_expert_used=2, n_ff_exp=s.n_ff_exp or s.n_ff // 4)
    if arch not in MOE_ARCHS:
        s = replace(s, n_expert=0, n_expert_used=0, n_ff_exp=0)
    if min(s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab, s.head_dim) < 1 or s.n_head % s.n_head_kv:
        raise ValueError(f"invalid shape {s}: sizes must be >= 1 and n_head a multiple of n_head_kv")
    if arch in MOE_ARCHS and not (1 <= s.n_expert_used <= s.n_expert and s.n_ff_exp >= 1):
        raise ValueError(f"invalid experts: {s.n_expert_used} used of {s.n_expert}, width {s.n_ff_exp}")
    if not (0 <= s.n_layer_dense_lead < s.n_layer and 0 < s.n_rot <= hd and s.n_rot % 2 == 0):
        raise ValueError(f"invalid shape: {s.n_layer_dense_lead} dense layers of {s.n_layer}, n_rot {s.n_rot} "
                         f"(even, at most the head's {hd})")
    return s


@dataclass(frozen=True)
class Draw:
    """How one tensor's values are drawn: N(mean, std)."""

    std: float
    mean: float = 0.0
    row_scale: tuple[float, ...] = ()  # F32 only: row i (ne[0] values) times row_scale[i]


def router_row_scales(n_expert: int, skew: float, il: int) -> tuple[float, ...]:
    """The router row scales of layer il for ModelShape.router_skew: (1 + rank)^-skew over a per-layer shuffle of
    the experts (seeded by il), normalized to a mean square of 1."""
    ranks = np.random.default_rng([0x5EED, il]).permutation(n_expert)
    scale = (1.0 + ranks) ** -float(skew)
    scale /= np.sqrt(np.mean(scale ** 2))
    return tuple(float(v) for v in scale)


def tensor_list(arch: str, s: ModelShape) -> list[tuple[str, tuple[int, ...], str, int, Draw]]:
    """(name, ne, kind, layer or -1, draw) of every tensor, in llama.cpp's names and file order."""
    hd, q, kv = s.head_dim, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = []

    def mat(name, kind, il, *ne):
        out.append((name, tuple(ne), kind, il, Draw(matrix_std(kind, ne[0]))))

    def vec(name, kind, il, *ne):  # 1-D, or gpt-oss's expert biases (ne0, n_expert): F32
        mean, sd = _VECTOR_DRAW[kind]
        out.append((name, tuple(ne), kind, il, Draw(sd, mean)))

    biases = arch in ("qwen2", "glm4moe", "gpt-oss")
    ffn_norm = "post_attention_norm" if arch in ("glm4moe", "gpt-oss") else "ffn_norm"  # llama.cpp's names
    mat("token_embd.weight", "token_embd", -1, s.n_embd, s.n_vocab)
    for il in range(s.n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", "attn_norm", il, s.n_embd)
        mat(p + "attn_q.weight", "attn_q", il, s.n_embd, q)
        mat(p + "attn_k.weight", "attn_k", il, s.n_embd, kv)
        mat(p + "attn_v.weight", "attn_v", il, s.n_embd, kv)
        if biases:
            vec(p + "attn_q.bias", "attn_q.bias", il, q)
            vec(p + "attn_k.bias", "attn_k.bias", il, kv)
            vec(p + "attn_v.bias", "attn_v.bias", il, kv)
        if s.qk_norm:
            vec(p + "attn_q_norm.weight", "attn_q_norm", il, hd)
            vec(p + "attn_k_norm.weight", "attn_k_norm", il, hd)
        mat(p + "attn_output.weight", "attn_output", il, q, s.n_embd)
        if arch == "gpt-oss":
            vec(p + "attn_output.bias", "attn_output.bias", il, s.n_embd)
            vec(p + "attn_sinks.weight", "attn_sinks", il, s.n_head)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", "post_attention_norm", il, s.n_embd)
        vec(p + f"{ffn_norm}.weight", ffn_norm, il, s.n_embd)
        if s.n_expert and il >= s.n_layer_dense_lead:
            _moe_tensors(arch, s, il, p, mat, vec, out)
        else:
            mat(p + "ffn_gate.weight", "ffn_gate", il, s.n_embd, s.n_ff)
            mat(p + "ffn_up.weight", "ffn_up", il, s.n_embd, s.n_ff)
            mat(p + "ffn_down.weight", "ffn_down", il, s.n_ff, s.n_embd)
        if arch == "gemma3":
            vec(p + "post_ffw_norm.weight", "post_ffw_norm", il, s.n_embd)
    vec("output_norm.weight", "output_norm", -1, s.n_embd)
    if not s.tied:
        mat("output.weight", "output", -1, s.n_embd, s.n_vocab)
    return out


def _moe_tensors(arch: str, s: ModelShape, il: int, p: str, mat, vec, out: list) -> None:
    """A MoE layer's router, experts (ne: n_in, n_out, n_expert), and glm4moe's selection bias and shared expert,
    gpt-oss's router and expert biases; llama.cpp's names."""
    mat(p + "ffn_gate_inp.weight", "ffn_gate_inp", il, s.n_embd, s.n_expert)
    if s.router_skew:
        name, ne, kind, _, d = out[-1]
        out[-1] = (name, ne, kind, il, replace(d, row_scale=router_row_scales(s.n_expert, s.router_skew, il)))
    if arch == "gpt-oss":
        vec(p + "ffn_gate_inp.bias", "ffn_gate_inp.bias", il, s.n_expert)
    if arch == "glm4moe":
        vec(p + "exp_probs_b.bias", "exp_probs_b", il, s.n_expert)
    for kind, n_in, n_out in (("ffn_gate_exps", s.n_embd, s.n_ff_exp), ("ffn_up_exps", s.n_embd, s.n_ff_exp),
                              ("ffn_down_exps", s.n_ff_exp, s.n_embd)):
        mat(p + kind + ".weight", kind, il, n_in, n_out, s.n_expert)
        if arch == "gpt-oss":
            vec(p + kind + ".bias", kind + ".bias", il, n_out, s.n_expert)
    if s.n_expert_shared:
        w = s.n_ff_exp * s.n_expert_shared
        mat(p + "ffn_gate_shexp.weight", "ffn_gate_shexp", il, s.n_embd, w)
        mat(p + "ffn_up_shexp.weight", "ffn_up_shexp", il, s.n_embd, w)
        mat(p + "ffn_down_shexp.weight", "ffn_down_shexp", il, w, s.n_embd)


@dataclass(frozen=True)
class SynthPlan:
    """Everything about a synthetic model except its weight bytes: `layout.file_size` is the file's size."""

    arch: str
    shape: ModelShape
    qtype_mix: str
    tensors: tuple[TensorEntry, ...]
    draws: tuple[Draw, ...]  # per tensor
    metadata: tuple[tuple[str, object, object], ...]  # (key, value, GGUF value type)
    layout: GGUFLayout


_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
               "Q3_K": 12, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32,
               "Q4_K_M": 15, "MXFP4": 38, "MXFP4_MOE": 38}  # llama_ftype (uniform K types by their _S/_M variant)


def _hparams(arch: str, s: ModelShape, qtype_mix: str, name: str) -> list[tuple[str, object, object]]:
    a = arch
    md = [("general.architecture", arch, STRING), ("general.name", name, STRING),
          (f"{a}.context_length", s.n_ctx_train, U32), (f"{a}.embedding_length", s.n_embd, U32),
          (f"{a}.block_count", s.n_layer, U32), (f"{a}.feed_forward_length", s.n_ff, U32),
          (f"{a}.attention.head_count", s.n_head, U32), (f"{a}.attention.head_count_kv", s.n_head_kv, U32),
          (f"{a}.rope.freq_base", s.rope_freq_base, F32),
          (f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps, F32)]
    if arch in ("qwen3", "qwen3moe", "gemma3") or s.head_dim != s.n_embd // s.n_head:
        md += [(f"{a}.attention.key_length", s.head_dim, U32), (f"{a}.attention.value_length", s.head_dim, U32)]
    if arch in MOE_ARCHS:
        md += [(f"{a}.expert_count", s.n_expert, U32), (f"{a}.expert_used_count", s.n_expert_used, U32),
               (f"{a}.expert_feed_forward_length", s.n_ff_exp, U32)]
    if arch == "glm4moe":  # llama.cpp's LLM_KV_ names; gating 2 = LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        md += [(f"{a}.leading_dense_block_count", s.n_layer_dense_lead, U32),
               (f"{a}.expert_shared_count", s.n_expert_shared, U32), (f"{a}.expert_gating_func", 2, U32),
               (f"{a}.expert_weights_scale", 1.0, F32), (f"{a}.expert_weights_norm", True, BOOL)]
    if arch == "gpt-oss":  # sliding on the even layers (llama.cpp's default sliding_window_pattern 2)
        md += [(f"{a}.rope.scaling.type", "yarn", STRING), (f"{a}.rope.scaling.factor", _GPT_OSS_YARN[0], F32),
               (f"{a}.rope.scaling.original_context_length", _GPT_OSS_YARN[1], U32)]
    if arch in ("gemma3", "gpt-oss"):
        md.append((f"{a}.attention.sliding_window", s.n_swa, U32))
    if arch == "glm4moe" or (arch != "llama" and s.n_rot != s.head_dim):
        md.append((f"{a}.rope.dimension_count", s.n_rot, U32))
    if arch == "llama":
        md += [(f"{a}.rope.dimension_count", s.head_dim, U32), (f"{a}.vocab_size", s.n_vocab, U32)]
    md += [("general.file_type", _FILE_TYPES.get(qtype_mix, 1), U32), ("general.quantization_version", 2, U32),
           ("general.alignment", 32, U32)]
    return md


def plan_model(arch: str, shape: str | ModelShape, qtype_mix: str = "Q4_K_M", vocab_gguf: str | Path | None = None,
               name: str | None = None, **overrides) -> SynthPlan:
    """The tensors, types, metadata and byte layout of a synthetic model, without writing anything.

    `qtype_mix`: "Q4_K_M" (llama.cpp's rules) or one type for every matrix ("Q8_0", "F16", ...); norms,
    biases and the MoE router are F32. With `vocab_gguf`, its `tokenizer.*` keys are copied (tokens padded
    with [PADi] up to n_vocab; n_vocab grows to the vocabulary's size if that is larger)."""
    s = resolve_shape(arch, shape, **overrides)
    if vocab_gguf is not None:
        vocab = vocab_from_gguf(vocab_gguf, s.n_vocab)
        s = replace(s, n_vocab=len(vocab[1][1]))  # the tokens
    else:
        vocab = synthetic_vocab(s.n_vocab)
    if name is None:
        name = f"synthetic-{arch}-{shape if isinstance(shape, str) else 'custom'}"
    specs = tensor_list(arch, s)
    entries = tuple(TensorEntry(n, ne, tensor_type(arch, s, qtype_mix, kind, il, ne)) for n, ne, kind, il, _ in specs)
    metadata = tuple(_hparams(arch, s, qtype_mix, name) + vocab)
    return SynthPlan(arch, s, qtype_mix, entries, tuple(d for *_, d in specs), metadata, layout(metadata, entries))


def planned_size(preset: str | ModelShape, arch: str = "llama", qtype_mix: str = "Q4_K_M",
                 vocab_gguf: str | Path | None = None, **overrides) -> int:
    """The byte size of the file `make_model` would write (a dry run)."""
    return plan_model(arch, preset, qtype_mix, vocab_gguf, **overrides).layout.file_size


def make_model(path: str | Path, arch: str, shape: str | ModelShape, qtype_mix: str = "Q4_K_M", seed: int = 0,
               vocab_gguf: str | Path | None = None, name: str | None = None, threads: int | None = None,
               on_tensor: Callable[[int, TensorEntry], None] | None = None, **overrides) -> SynthPlan:
    """Write a synthetic GGUF to `path` (arguments as `plan_model`, then `write_plan`); returns its plan."""
    plan = plan_model(arch, shape, qtype_mix, vocab_gguf, name, **overrides)
    write_plan(path, plan, seed, threads, on_tensor)
    return plan


def write_plan(path: str | Path, plan: SynthPlan, seed: int = 0, threads: int | None = None,
               on_tensor: Callable[[int, TensorEntry], None] | None = None) -> int:
    """Write the model of `plan` with weights drawn from `seed`; returns the file size.

    Weight bytes are generated in chunks on `threads` threads (default: up to 8 cores) and written in order,
    so memory stays at a few hundred MB whatever the model size. `on_tensor(i, entry)` reports progress."""
    threads = threads or max(1, min(8, os.cpu_count() or 1))
    draws = dict(zip((t.name for t in plan.tensors), plan.draws))
    with ThreadPoolExecutor(threads) as pool:

        def data(t: TensorEntry):
            d = draws[t.name]
            if d.row_scale:  # a small F32 matrix (the router): drawn whole, each row scaled
                if t.type_name != "F32":
                    raise ValueError(f"{t.name}: row scales need an F32 tensor, not {t.type_name}")
                vals = random_tensor(seed, t.name, "F32", t.n_elements, d.std, d.mean).view("<f4")
                scale = np.asarray(d.row_scale, dtype=np.float32)
                yield (vals.reshape(len(scale), -1) * scale[:, None]).astype("<f4").reshape(-1).view(np.uint8)
                return
            pending = deque()
            for job in chunk_jobs(seed, t.name, t.type_name, t.n_elements, d.std, d.mean):
                pending.append(pool.submit(job))
                if len(pending) > 2 * threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

        return write_gguf(path, plan.layout, plan.tensors, data, on_tensor=on_tensor)
