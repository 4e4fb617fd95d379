"""Which GGML type each tensor of a synthetic model gets: llama.cpp's Q4_K_M or MXFP4_MOE rules, or one uniform type.

Follows `llama_tensor_get_type` (src/llama-quant.cpp) for LLAMA_FTYPE_MOSTLY_Q4_K_M, including the
fallbacks for rows that are not whole blocks. 1-D tensors and the MoE router stay F32, as llama-quantize does.
"""

from __future__ import annotations

from gguf_io.ggml_types import GGML_TYPE_IDS, GGML_TYPES

from hybrid.tools.synth.blocks import SUPPORTED_TYPES

MIXES = ("Q4_K_M", "MXFP4_MOE") + SUPPORTED_TYPES
# llama.cpp's fallback when ne[0] is not a multiple of the type's block; F16 when that does not fit either
_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp: the first and last eighth of the layers, and every third layer in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _block(type_name: str) -> int:
    return GGML_TYPES[GGML_TYPE_IDS[type_name]].block_size


def fit_row(type_name: str, ne0: int) -> str:
    """`type_name`, or llama.cpp's fallback type when a row of `ne0` elements is not whole blocks."""
    if ne0 % _block(type_name):
        type_name = _FALLBACK.get(type_name, "F16")
        if ne0 % _block(type_name):
            type_name = "F16"
    return type_name


def _q4_k_m(arch: str, shape, kind: str, il: int, ne0: int) -> str:
    n_layer = shape.n_layer
    if kind == "output" or (kind == "token_embd" and shape.tied):
        return "Q8_0" if ne0 % 256 else "Q6_K"
    new = "Q4_K"
    if kind == "attn_v":
        new = "Q6_K" if use_more_bits(il, n_layer) else "Q4_K"
        # LLM_TYPE_70B (80 layers with GQA, llama/qwen2): attn_v is 8x smaller than attn_q, so give it more bits
        if arch in ("llama", "qwen2") and n_layer == 80 and shape.n_head != shape.n_head_kv and new == "Q4_K":
            new = "Q5_K"
        if shape.n_expert == 8:
            new = "Q8_0"
    elif kind == "attn_k" and shape.n_expert == 8:
        new = "Q8_0"
    elif kind == "attn_output" and shape.n_expert == 8:
        new = "Q5_K"
    elif kind in ("ffn_down", "ffn_down_exps", "ffn_down_shexp") and use_more_bits(il, n_layer):
        new = "Q6_K"
    return new


def tensor_type(arch: str, shape, qtype_mix: str, kind: str, il: int, ne: tuple[int, ...]) -> str:
    """The GGML type of tensor `kind` ("attn_v", "attn_norm", ...) of layer `il` (-1: none) with ggml shape `ne`."""
    if qtype_mix not in MIXES:
        raise ValueError(f"unknown type mix {qtype_mix!r}; choose one of {', '.join(MIXES)}")
    if len(ne) == 1 or kind == "ffn_gate_inp" or kind.endswith(".bias"):  # gpt-oss's expert biases are 2-D
        return "F32"
    if qtype_mix == "Q4_K_M":
        return fit_row(_q4_k_m(arch, shape, kind, il, ne[0]), ne[0])
    if qtype_mix == "MXFP4_MOE":  # llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE: expert tensors MXFP4, the rest Q8_0
        return fit_row("MXFP4" if len(ne) == 3 and ne[2] > 1 else "Q8_0", ne[0])
    return fit_row(qtype_mix, ne[0])
