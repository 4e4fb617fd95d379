"""Multi-head latent attention (deepseek2), in the absorbed form llama.cpp runs (src/models/deepseek2.cpp).

Per token: kv = attn_kv_a_mqa @ h = [c (kv_lora_rank) | k_pe (n_rot)]; c = rmsnorm(c) * attn_kv_a_norm; k_pe, one
rope key shared by all heads, rotated. Queries: q = attn_q_b @ rmsnorm(attn_q_a @ h) (or attn_q @ h), per head
[q_nope | q_pe], q_pe rotated; q_nope absorbed into the latent space, attn_k_b[head] @ q_nope. Then attention is
MQA over one KV head: key [c | k_pe] (kv_lora_rank + n_rot = key_length), value c (value_length), so the KV
cache holds the compressed latent and the rope key only (hybrid.kv.cache: one row, read as the key and as the
value, whose first kv_lora_rank dims are c); each head's output leaves the latent by attn_v_b[head].
"""

from __future__ import annotations

import numpy as np

from gguf_io import ModelConfig

from hybrid.model.arch.attend import attend
from hybrid.model.weights import Weight


def mla_attention(be, cfg: ModelConfig, lw: dict[str, Weight], il: int, h, positions: np.ndarray, kv,
                  rope_args: tuple):
    """The attention output of the normed h (n, n_embd) f32 -> (n, n_embd) f32; rope_args = (base, freq_scale,
    yarn) of the layer. Stores [c | k_pe] and c of the batch in kv.layers[il]."""
    n, n_head, eps = h.shape[0], cfg.n_head, cfg.f_norm_rms_eps
    rank, n_rot, v_mla = cfg.n_lora_kv, cfg.n_rot, cfg.n_embd_head_v_mla
    nope = cfg.n_embd_head_k_mla - n_rot
    base, fscale, yarn = rope_args
    if "attn_q_a" in lw:
        qa, ckv = be.matmuls((lw["attn_q_a"], lw["attn_kv_a_mqa"]), h)  # (n, q_lora_rank), (n, rank + n_rot)
        q = be.matmul(lw["attn_q_b"], be.rms_norm(qa, lw["attn_q_a_norm"].raw, eps))
    else:  # the lite variants: no q compression
        q, ckv = be.matmuls((lw["attn_q"], lw["attn_kv_a_mqa"]), h)
    q = q.reshape(n, n_head, nope + n_rot)
    q_pe = be.rope(q[:, :, nope:], positions, n_rot, base, fscale, "norm", yarn)  # (n, n_head, n_rot)
    k_pe = be.rope(ckv[:, rank:].reshape(n, 1, n_rot), positions, n_rot, base, fscale, "norm", yarn)
    c = be.rms_norm(ckv[:, :rank], lw["attn_kv_a_norm"].raw, eps)  # (n, rank)

    q_abs = be.zeros((n, n_head, rank + n_rot))  # per head [attn_k_b[head] @ q_nope | q_pe]
    k_b = lw["attn_k_b"]  # (n_head, rank, nope)
    for hd in range(n_head):
        q_abs[:, hd, :rank] = be.matmul(k_b.expert(hd), q[:, hd, :nope])
    q_abs[:, :, rank:] = q_pe
    key = be.zeros((n, 1, rank + n_rot))
    key[:, 0, :rank] = c
    key[:, :, rank:] = k_pe
    # the value row is the key row (one storage); kv: a cache, or a ragged batch's (attend: through each sequence's)
    o = attend(be, kv, il, q_abs, key, key, positions, cfg.f_attention_scale, 0)[:, :, :rank]  # (n, n_head, rank)

    v_b = lw["attn_v_b"]  # (n_head, v_mla, rank)
    out = be.zeros((n, n_head * v_mla))
    for hd in range(n_head):
        out[:, hd * v_mla:(hd + 1) * v_mla] = be.matmul(v_b.expert(hd), o[:, hd, :])
    return be.matmul(lw["attn_output"], out)
