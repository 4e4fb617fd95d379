"""`ModelConfig`: the hyperparameters of a model from its `{arch}.*` metadata, with llama.cpp's names and defaults.

Follows llama.cpp's `llama_model::load_hparams` (src/llama-model.cpp) for the supported architectures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config_moe import gpt_oss_swa, mla_keys, mla_kq_scale, moe_keys, yarn_corr_dims, yarn_keys
from .errors import GGUFFormatError, UnsupportedArchitecture
from .metadata import describe

SUPPORTED_ARCHITECTURES = ("deepseek2", "gemma3", "glm4moe", "gpt-oss", "llama", "qwen2", "qwen3", "qwen3moe")
# llama.cpp's llama_model_rope_type(): LLAMA_ROPE_TYPE_NORM for llama and deepseek2, NEOX for the others.
ROPE_TYPES = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "qwen3moe": "neox", "gemma3": "neox",
              "glm4moe": "neox", "deepseek2": "norm", "gpt-oss": "neox"}
GEMMA3_SWA_PATTERN = 6  # set_swa_pattern(6): 5 sliding-window layers, then 1 global layer
GEMMA3_ROPE_FREQ_BASE_SWA = 10000.0  # hard-coded by llama.cpp (rope_freq_base_train_swa)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    n_rot: int
    rope_type: str  # "norm" (consecutive pairs) or "neox" (halves)
    rope_freq_base: float
    rope_freq_base_swa: float  # base of the sliding-window layers (gemma3: 10000)
    rope_freq_scale: float  # 1 / rope.scaling.factor, 1.0 without scaling
    rope_scaling_type: str  # "none", "linear" or "yarn" (llama.cpp's default is "linear")
    f_norm_rms_eps: float
    f_attention_scale: float  # the KQ scale: 1/sqrt(n_embd_head_k) (gemma3 27B: 1/sqrt(n_embd/n_head))
    n_swa: int  # sliding window size, 0 when none
    swa_layers: tuple[bool, ...]  # per layer: does it use the sliding window?
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    tied_output: bool  # no `output.weight`: the LM head is `token_embd.weight`
    file_type: int | None
    # MoE layouts beyond qwen3moe (glm4moe, deepseek2): llama.cpp's hparams of the same names
    n_layer_dense_lead: int = 0  # the first layers have a dense FFN
    n_layer_nextn: int = 0  # NextN/MTP blocks after the n_layer ones (in the file, never run)
    n_expert_shared: int = 0  # shared experts (ffn_*_shexp, width n_ff_exp * n_expert_shared)
    expert_gating_func: str = "softmax"  # "softmax" or "sigmoid" of the router logits
    expert_weights_norm: bool = False  # renormalize the selected weights to sum 1 (metadata; qwen3moe: spec)
    expert_weights_scale: float = 0.0  # multiply the selected weights (0 or 1: no scaling)
    n_expert_groups: int = 0  # group-limited routing: experts in this many groups ...
    n_group_used: int = 0  # ... of which the best (sum of the top 2 scores) this many are kept
    # MLA (deepseek2): q_lora rank (0: attn_q directly), compressed KV rank, per-head q/k and v widths
    n_lora_q: int = 0
    n_lora_kv: int = 0
    n_embd_head_k_mla: int = 0
    n_embd_head_v_mla: int = 0
    # YaRN (rope.scaling.type yarn): ggml_rope_ext's ext_factor, attn_factor and the corrected dims
    yarn_ext_factor: float = 0.0
    yarn_attn_factor: float = 1.0
    n_ctx_orig_yarn: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_corr_dims: tuple[float, float] = (0.0, 0.0)  # ggml_rope_yarn_corr_dims of n_rot, n_ctx_orig_yarn, base
    rope_freq_scale_swa: float = 1.0  # freq scale of the sliding-window layers (gemma3: 1; gpt-oss: rope_freq_scale)

    @property
    def rope_yarn(self) -> tuple[float, float, float, float] | None:
        """(ext_factor, attn_factor, corr_lo, corr_hi) for a rope with YaRN or an attention factor, else None."""
        if not self.yarn_ext_factor and self.yarn_attn_factor == 1.0:
            return None
        return (self.yarn_ext_factor, self.yarn_attn_factor, *self.yarn_corr_dims)

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def n_embd_k_gqa(self) -> int:
        """Width of the K cache row of one token in one layer."""
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def rope_base(self, il: int) -> float:
        """The RoPE frequency base of layer `il` (sliding-window layers may use their own)."""
        return self.rope_freq_base_swa if self.swa_layers[il] else self.rope_freq_base

    @classmethod
    def from_gguf(cls, f) -> ModelConfig:
        """The config of an open `GGUFFile` (GGUFFormatError for missing or bad keys)."""
        arch = f.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        md = _Keys(f.metadata, arch, str(f.path))
        n_layer_all = md.get_int("block_count", minimum=1)
        n_layer_nextn = md.get_int("nextn_predict_layers", default=0, minimum=0)
        if n_layer_nextn >= n_layer_all:
            raise md.fail(f"nextn_predict_layers ({n_layer_nextn}) must be below block_count ({n_layer_all})")
        n_layer = n_layer_all - n_layer_nextn  # llama.cpp's main graph skips the trailing NextN/MTP blocks
        n_embd = md.get_int("embedding_length", minimum=1)
        n_head = md.per_layer("attention.head_count", n_layer, minimum=1)
        n_head_kv = md.per_layer("attention.head_count_kv", n_layer, default=n_head, minimum=1)
        if n_head % n_head_kv:
            raise md.fail(f"attention.head_count ({n_head}) must be a multiple of attention.head_count_kv ({n_head_kv})")
        n_embd_head_k = md.get_int("attention.key_length", default=n_embd // n_head, minimum=1)
        n_embd_head_v = md.get_int("attention.value_length", default=n_embd // n_head, minimum=1)
        n_rot = md.get_int("rope.dimension_count", default=n_embd_head_k, minimum=0)
        if arch == "llama" and n_rot != n_embd_head_k:
            raise md.fail(f"invalid n_rot {n_rot} for llama: expected the head size {n_embd_head_k}")

        rope_freq_base = md.get_float("rope.freq_base", default=10000.0)
        factor = md.get_float("rope.scaling.factor", default=None)
        if factor is None:
            factor = md.get_float("rope.scale_linear", default=0.0)
        rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
        scaling_type = md.get_str("rope.scaling.type", default="linear")
        if scaling_type not in ("none", "linear", "yarn"):
            raise md.fail(f"rope.scaling.type must be none, linear or yarn, found {scaling_type!r}")

        n_expert = md.get_int("expert_count", default=0, minimum=0)
        n_expert_used = md.get_int("expert_used_count", default=0, minimum=0)
        if n_expert_used > n_expert or (n_expert > 0) != (n_expert_used > 0):
            raise md.fail(f"expert_used_count {n_expert_used} is invalid for expert_count {n_expert}")
        n_ff_exp = md.get_int("expert_feed_forward_length", default=0, minimum=0)
        if arch in ("qwen3moe", "glm4moe", "deepseek2", "gpt-oss") and (n_expert == 0 or n_ff_exp == 0):
            raise md.fail(f"{arch} needs expert_count and expert_feed_forward_length, found {n_expert}, {n_ff_exp}")
        moe = moe_keys(md, arch, n_expert)
        mla = mla_keys(md, arch, n_embd_head_k, n_embd_head_v, n_rot)
        yarn = yarn_keys(md, arch, rope_freq_scale, scaling_type, md.get_int("context_length", minimum=1))
        yarn["yarn_corr_dims"] = yarn_corr_dims(n_rot, yarn["n_ctx_orig_yarn"], rope_freq_base)

        swa_extra: dict = {}
        if arch == "gemma3":
            n_swa = md.get_int("attention.sliding_window", minimum=1)
            swa_layers = tuple(il % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for il in range(n_layer))
            rope_freq_base_swa = GEMMA3_ROPE_FREQ_BASE_SWA
            # llama.cpp: the 27B model (62 layers) scales by 1/sqrt(n_embd/n_head) (query_pre_attn_scalar)
            head_for_scale = n_embd // n_head if n_layer == 62 else n_embd_head_k
        elif arch == "gpt-oss":
            n_swa, swa_layers = gpt_oss_swa(md, n_layer)
            head_for_scale = n_embd_head_k
            rope_freq_base_swa = md.get_float("rope.freq_base_swa", default=rope_freq_base)
            swa_extra["rope_freq_scale_swa"] = rope_freq_scale  # llama.cpp: the SWA layers keep the train scale
        else:
            n_swa, swa_layers, head_for_scale = 0, (False,) * n_layer, n_embd_head_k
            rope_freq_base_swa = md.get_float("rope.freq_base_swa", default=rope_freq_base)
        f_attention_scale = 1.0 / math.sqrt(head_for_scale)
        if arch == "deepseek2":
            f_attention_scale = mla_kq_scale(yarn, rope_freq_scale, mla["n_embd_head_k_mla"])

        n_vocab = md.get_int("vocab_size", default=_fallback_n_vocab(f), minimum=1)
        if n_vocab is None:
            raise md.fail(
                f"cannot tell the vocabulary size: no {arch}.vocab_size, tokenizer.ggml.tokens or token_embd.weight"
            )
        file_type = f.metadata.get("general.file_type")
        name = f.metadata.get("general.name", "")
        return cls(
            arch=arch,
            name=name if isinstance(name, str) else str(name),
            n_vocab=n_vocab,
            n_ctx_train=md.get_int("context_length", minimum=1),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_embd_head_k=n_embd_head_k,
            n_embd_head_v=n_embd_head_v,
            n_ff=md.per_layer("feed_forward_length", n_layer, default=0, minimum=0),
            n_rot=n_rot,
            rope_type=ROPE_TYPES[arch],
            rope_freq_base=rope_freq_base,
            rope_freq_base_swa=rope_freq_base_swa,
            rope_freq_scale=rope_freq_scale,
            rope_scaling_type=scaling_type,
            f_norm_rms_eps=md.get_float("attention.layer_norm_rms_epsilon"),
            f_attention_scale=f_attention_scale,
            n_swa=n_swa,
            swa_layers=swa_layers,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            attn_logit_softcapping=md.get_float("attn_logit_softcapping", default=None),
            final_logit_softcapping=md.get_float("final_logit_softcapping", default=None),
            tied_output="output.weight" not in f.tensors,
            file_type=file_type if isinstance(file_type, int) and not isinstance(file_type, bool) else None,
            n_layer_nextn=n_layer_nextn,
            **moe,
            **mla,
            **{k: v for k, v in yarn.items() if k != "rope_yarn_log_mul"},
            **swa_extra,
        )


def _fallback_n_vocab(f) -> int | None:
    """len(tokenizer.ggml.tokens), else the rows of token_embd.weight, else None."""
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    embd = f.tensors.get("token_embd.weight")
    return embd.ne[1] if embd is not None and len(embd.ne) > 1 else None


_REQUIRED = object()


class _Keys:
    """Typed access to `{arch}.{suffix}` metadata, failing with the key's full name."""

    def __init__(self, metadata: dict, arch: str, where: str):
        self.metadata, self.arch, self.where = metadata, arch, where

    def fail(self, msg: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.where}: {self.arch}: {msg}")

    def _lookup(self, suffix: str, default) -> tuple[str, object, bool]:
        key = f"{self.arch}.{suffix}"
        if key in self.metadata:
            return key, self.metadata[key], True
        if default is _REQUIRED:
            raise self.fail(f"missing metadata key {key!r} (required for {self.arch})")
        return key, default, False

    def get_int(self, suffix: str, default=_REQUIRED, minimum: int | None = None):
        key, v, found = self._lookup(suffix, default)
        if not found:
            return v
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(f"{key} must be an integer, found {describe(v)}")
        return self._at_least(key, v, minimum)

    def per_layer(self, suffix: str, n_layer: int, default=_REQUIRED, minimum: int | None = None):
        """A key that llama.cpp also accepts as a per-layer array; hybrid needs one value for every layer."""
        key = f"{self.arch}.{suffix}"
        v = self.metadata.get(key)
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "iu" or len(v) != n_layer or (v != v[0]).any():
                raise self.fail(f"{key}: per-layer values {v[:8].tolist()} are not supported (need one value)")
            return self._at_least(key, int(v[0]), minimum)
        return self.get_int(suffix, default, minimum)

    def _at_least(self, key: str, v: int, minimum: int | None) -> int:
        if minimum is not None and v < minimum:
            raise self.fail(f"{key} must be >= {minimum}, found {v}")
        return v

    def get_float(self, suffix: str, default=_REQUIRED):
        key, v, found = self._lookup(suffix, default)
        if not found:
            return v
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise self.fail(f"{key} must be a finite number, found {describe(v)}")
        return float(v)

    def get_bool(self, suffix: str, default=_REQUIRED):
        key, v, found = self._lookup(suffix, default)
        if found and not isinstance(v, bool):
            raise self.fail(f"{key} must be a boolean, found {describe(v)}")
        return v

    def get_str(self, suffix: str, default=_REQUIRED):
        key, v, found = self._lookup(suffix, default)
        if found and not isinstance(v, str):
            raise self.fail(f"{key} must be a string, found {describe(v)}")
        return v
