"""The hyperparameters of the MoE and MLA architectures beyond qwen3moe (glm4moe, deepseek2, gpt-oss: routing,
MLA, gpt-oss's sliding-window pattern) and of YaRN, from `{arch}.*` metadata as llama.cpp's load_arch_hparams and
llama_context read them; `ModelConfig.from_gguf` calls these with its typed key reader."""

from __future__ import annotations

import math

import numpy as np

# llama_expert_gating_func_type: 0 (none: the arch's default), 1 softmax, 2 sigmoid
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
# the arch's gating when the file says none (llama.cpp: glm4moe sigmoid; deepseek2 softmax, as V2/V2.5 files)
DEFAULT_GATING = {"glm4moe": "sigmoid"}
# gating llama.cpp's graph hard-codes, whatever the file says: gpt-oss selects the top k of the raw logits and
# takes the softmax of the k selected (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
FORCED_GATING = {"gpt-oss": "softmax_weight"}
GPT_OSS_SWA_PATTERN = 2  # llama.cpp's load_swa_pattern(ml, 2) for gpt-oss: even layers SWA, odd layers full


def moe_keys(md, arch: str, n_expert: int) -> dict:
    """The MoE fields beyond expert_count/used (llama.cpp's load_arch_hparams of glm4moe and deepseek2)."""
    gating = md.get_int("expert_gating_func", default=0, minimum=0)
    if gating and gating not in GATING_FUNCS:
        raise md.fail(f"expert_gating_func {gating} is not supported (supported: 1 softmax, 2 sigmoid)")
    groups = md.get_int("expert_group_count", default=0, minimum=0)
    used = md.get_int("expert_group_used_count", default=0, minimum=0)
    if groups > 1 and (n_expert % groups or not 0 < used <= groups):
        raise md.fail(f"expert_group_count {groups} / expert_group_used_count {used} do not fit {n_expert} experts")
    return dict(
        n_layer_dense_lead=md.get_int("leading_dense_block_count", default=0, minimum=0),
        n_expert_shared=md.get_int("expert_shared_count", default=0, minimum=0),
        expert_gating_func=FORCED_GATING.get(arch) or GATING_FUNCS.get(gating) or DEFAULT_GATING.get(arch, "softmax"),
        expert_weights_norm=md.get_bool("expert_weights_norm", default=False),
        expert_weights_scale=md.get_float("expert_weights_scale", default=0.0),
        n_expert_groups=groups,
        n_group_used=used,
    )


def gpt_oss_swa(md, n_layer: int) -> tuple[int, tuple[bool, ...]]:
    """(n_swa, per-layer SWA flags) as llama.cpp's load_swa_pattern reads them: attention.sliding_window_pattern as
    a per-layer bool array, or as a period n (layer il slides iff il % n < n - 1; n = 0: every layer), default 2."""
    n_swa = md.get_int("attention.sliding_window", minimum=1)
    key = f"{md.arch}.attention.sliding_window_pattern"
    pattern = md.metadata.get(key)
    if isinstance(pattern, (np.ndarray, list)):
        flags = np.asarray(pattern)
        if flags.dtype.kind not in "biu" or flags.shape != (n_layer,):
            raise md.fail(f"{key}: expected {n_layer} booleans, found {flags.dtype} {flags.shape}")
        return n_swa, tuple(bool(f) for f in flags)
    n = md.get_int("attention.sliding_window_pattern", default=GPT_OSS_SWA_PATTERN, minimum=0)
    return n_swa, tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


def mla_keys(md, arch: str, n_embd_head_k: int, n_embd_head_v: int, n_rot: int) -> dict:
    """deepseek2's MLA sizes; key_length/value_length then describe the cached entry ([latent | rope key] and
    the latent), key_length_mla/value_length_mla the per-head q/k and v widths."""
    if arch != "deepseek2":
        return {}
    k_mla = md.get_int("attention.key_length_mla", default=0, minimum=0)
    v_mla = md.get_int("attention.value_length_mla", default=0, minimum=0)
    if not (k_mla and v_mla):
        raise md.fail("only the MLA layout (attention.key_length_mla, attn_k_b/attn_v_b) is supported; this file "
                      "has the older attn_kv_b layout (reconvert it with a current convert_hf_to_gguf.py)")
    n_lora_kv = md.get_int("attention.kv_lora_rank", minimum=1)
    if k_mla <= n_rot or n_embd_head_k != n_lora_kv + n_rot or n_embd_head_v != n_lora_kv:
        raise md.fail(f"MLA sizes do not fit: key_length {n_embd_head_k} (expected kv_lora_rank {n_lora_kv} + rope "
                      f"{n_rot}), value_length {n_embd_head_v} (expected {n_lora_kv}), key_length_mla {k_mla}")
    return dict(n_lora_q=md.get_int("attention.q_lora_rank", default=0, minimum=0), n_lora_kv=n_lora_kv,
                n_embd_head_k_mla=k_mla, n_embd_head_v_mla=v_mla)


def yarn_keys(md, arch: str, freq_scale: float, scaling_type: str, n_ctx_train: int) -> dict:
    """ggml_rope_ext's YaRN arguments as llama_context sets them (llama-context.cpp): ext_factor 1 for
    rope.scaling.type yarn, and attn_factor with YaRN's own magnitude factor cancelled (deepseek2 moves it into
    the KQ scale instead). float32 arithmetic, as there."""
    f32 = np.float32
    log_mul = md.get_float("rope.scaling.yarn_log_multiplier", default=0.0)
    if arch == "deepseek2" and log_mul:
        log_mul = float(f32(log_mul) / f32(0.1))  # llama.cpp cancels the converter's factor 0.1
    out = dict(n_ctx_orig_yarn=md.get_int("rope.scaling.original_context_length", default=n_ctx_train, minimum=1),
               rope_yarn_log_mul=log_mul)
    attn = f32(1.0)
    if scaling_type == "yarn":
        factor = f32(1.0) / f32(freq_scale)

        def mscale(m: float):
            return f32(1.0) if factor <= 1 else f32(0.1) * f32(m) * f32(np.log(factor)) + f32(1.0)

        if log_mul:
            m_all = f32(log_mul)
            m = m_all if arch == "deepseek2" and m_all != 1 else f32(1.0)
            attn = f32(mscale(m) / mscale(m_all))
        else:
            attn = mscale(1.0)
        attn = f32(attn * (f32(1.0) / (f32(1.0) + f32(0.1) * f32(np.log(factor)))))
        out["yarn_ext_factor"] = 1.0
    attn = f32(attn * f32(md.get_float("rope.scaling.attn_factor", default=1.0)))
    out["yarn_attn_factor"] = float(attn)
    return out


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float = 32.0,
                    beta_slow: float = 1.0) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims (float32): the dims from which YaRN interpolates and up to which it extrapolates."""
    f32 = np.float32
    if n_rot <= 0:
        return 0.0, 0.0

    def dim(beta: float):
        return f32(n_rot) * f32(np.log(f32(n_ctx_orig) / (f32(beta) * f32(2.0) * f32(math.pi)))) / (
            f32(2.0) * f32(np.log(f32(base))))

    return float(max(0.0, np.floor(dim(beta_fast)))), float(min(n_rot - 1, np.ceil(dim(beta_slow))))


def mla_kq_scale(yarn: dict, freq_scale: float, n_embd_head_k_mla: int) -> float:
    """deepseek2's KQ scale: mscale^2 / sqrt(key_length_mla), YaRN's magnitude moved from the rotation into it
    (src/models/deepseek2.cpp, float32)."""
    f32 = np.float32
    ln = f32(np.log(f32(1.0) / f32(freq_scale)))
    org = f32(f32(yarn["yarn_attn_factor"]) * (f32(1.0) + f32(0.1) * ln))
    m = f32(org * (f32(1.0) + f32(0.1) * f32(yarn["rope_yarn_log_mul"]) * ln))
    return float(f32(m * m) / f32(np.sqrt(f32(n_embd_head_k_mla))))
