"""The forward pass, written once: embed -> layers -> output head. Prefill, decode (GPU runs captured whole),
perplexity and the measured fit all go through these three pieces; each layer runs on its own backend."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gguf_io import ModelConfig

from hybrid.model.arch.blocks import layer_forward
from hybrid.model.arch.spec import ArchSpec
from hybrid.model.weights import ModelWeights


def embed(cpu, spec: ArchSpec, cfg: ModelConfig, weights: ModelWeights, tokens: np.ndarray) -> np.ndarray:
    """Token ids (n,) int64 -> hidden states (n, n_embd) float32 on the host (the embedding stays on the CPU)."""
    x = cpu.get_rows(weights.token_embd, tokens)
    if spec.embd_scale:
        x = x * np.float32(np.sqrt(cfg.n_embd))
    return x


def layers(spec: ArchSpec, cfg: ModelConfig, weights: ModelWeights, backends: Sequence, il_range: range, x,
           positions: np.ndarray, kv, layer_weights: Sequence | None = None):
    """Layers il_range on backends[il], x already on the first one's device (one device for the range)."""
    lws = weights.layers if layer_weights is None else layer_weights
    for il in il_range:
        x = layer_forward(backends[il], spec, cfg, lws[il], il, x, positions, kv)
    return x


def head(be, cfg: ModelConfig, output, output_norm, h):
    """Output norm and matmul on backend `be`: hidden states (n, n_embd) -> logits (n, n_vocab), on be's device."""
    return be.matmul(output, be.rms_norm(h, output_norm.raw, cfg.f_norm_rms_eps))


def softcap(cfg: ModelConfig, logits: np.ndarray) -> np.ndarray:
    """Final logit soft-capping (Gemma 2/3 style: tanh(x / cap) * cap) where the model has it, on host logits."""
    cap = cfg.final_logit_softcapping
    return np.tanh(logits / cap) * cap if cap else logits
