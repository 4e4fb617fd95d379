"""A routing trace: the experts (ids and weights) every MoE layer selected for every evaluated token, recorded while
a model evaluates a text (`record_trace`, `hybrid trace-experts`) and saved as an .npz file:

    ids       int16 (int32 past 32767 experts)  (n_tok, n_layer_moe, k)  each token's experts, in routing order
    weights   float32                           (n_tok, n_layer_moe, k)  their routing weights
    layers    int32   (n_layer_moe,)   the model's layer index of each column (a dense leading layer has none)
    chunk     int32   (n_tok,)         the evaluated chunk of each token (tokens in evaluation order)
    n_expert  int64   ()               experts per layer
    model     str     ()               the model's name (general.name, else the file name)
    version   int64   ()               TRACE_VERSION

The ids and weights are those the layer's backend computed and used (the CPU's compiled routing, the GPU's device
routing copied back, or the op-by-op reference), heard through model.arch.moe.RoutingObserver."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid.errors import HybridError

TRACE_VERSION = 1


@dataclass(frozen=True)
class ExpertTrace:
    ids: np.ndarray  # (n_tok, n_layer_moe, k) int16/int32
    weights: np.ndarray  # (n_tok, n_layer_moe, k) float32
    layers: np.ndarray  # (n_layer_moe,) int32
    chunk: np.ndarray  # (n_tok,) int32
    n_expert: int
    model: str

    @property
    def n_tok(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    def counts(self, tokens: slice = slice(None)) -> np.ndarray:
        """(n_layer_moe, n_expert) int64: the slots each expert took over the tokens `tokens`."""
        ids = self.ids[tokens]
        n_layer = ids.shape[1]
        flat = ids.transpose(1, 0, 2).reshape(n_layer, -1).astype(np.int64)
        flat += np.arange(n_layer)[:, None] * self.n_expert  # layer l's experts counted at l * n_expert + e
        return np.bincount(flat.reshape(-1), minlength=n_layer * self.n_expert).reshape(n_layer, self.n_expert)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, ids=self.ids, weights=self.weights, layers=self.layers, chunk=self.chunk,
                            n_expert=np.int64(self.n_expert), model=np.array(self.model),
                            version=np.int64(TRACE_VERSION))

    @classmethod
    def load(cls, path: str | Path) -> "ExpertTrace":
        """A trace saved by save(); HybridError when the file is not one (what is missing or wrong said)."""
        with np.load(path, allow_pickle=False) as z:
            missing = {"ids", "weights", "layers", "n_expert"} - set(z.files)
            if missing:
                raise HybridError(f"{path}: not an expert trace (missing {', '.join(sorted(missing))})")
            ids, weights = z["ids"], z["weights"]
            if ids.ndim != 3 or weights.shape != ids.shape or ids.shape[1] != z["layers"].shape[0]:
                raise HybridError(f"{path}: expected ids and weights (n_tok, n_layer, k) over {z['layers'].shape[0]} "
                                 f"layers, found {ids.shape} and {weights.shape}")
            chunk = z["chunk"] if "chunk" in z.files else np.zeros(ids.shape[0], dtype=np.int32)
            model = str(z["model"]) if "model" in z.files else ""
            return cls(ids, weights.astype(np.float32), z["layers"].astype(np.int32), chunk.astype(np.int32),
                       int(z["n_expert"]), model)


class RoutingRecorder:
    """A model.arch.moe.RoutingObserver that keeps every routing it hears, per layer, in order; `trace()` stacks
    them into an ExpertTrace."""

    def __init__(self, n_expert: int) -> None:
        self.n_expert = n_expert
        self.chunk_index = 0  # the chunk being evaluated (record_trace sets it)
        self._ids: dict[int, list[np.ndarray]] = {}
        self._weights: dict[int, list[np.ndarray]] = {}
        self._chunk: dict[int, list[np.ndarray]] = {}

    def routed(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        # copies: a caller may reuse its buffers
        self._ids.setdefault(layer, []).append(np.array(ids, dtype=np.int32))
        self._weights.setdefault(layer, []).append(np.array(weights, dtype=np.float32))
        self._chunk.setdefault(layer, []).append(np.full(ids.shape[0], self.chunk_index, dtype=np.int32))

    def trace(self, model: str) -> ExpertTrace:
        """What was heard, tokens in order; ValueError when the layers heard different numbers of tokens."""
        if not self._ids:
            raise ValueError("no MoE routing was recorded (a model without MoE layers?)")
        layers = sorted(self._ids)
        ids = [np.concatenate(self._ids[il]) for il in layers]
        n = {il: a.shape[0] for il, a in zip(layers, ids)}
        if len(set(n.values())) != 1:
            raise ValueError(f"the MoE layers heard different numbers of tokens: {n}")
        dtype = np.int16 if self.n_expert <= np.iinfo(np.int16).max else np.int32
        return ExpertTrace(np.stack(ids, axis=1).astype(dtype),
                           np.stack([np.concatenate(self._weights[il]) for il in layers], axis=1),
                           np.array(layers, dtype=np.int32), np.concatenate(self._chunk[layers[0]]), self.n_expert,
                           model)


def record_trace(engine, chunks: Sequence[Sequence[int]], model: str, n_batch: int,
                 progress: Callable[[int, int], None] | None = None) -> ExpertTrace:
    """Evaluate each chunk from an empty cache (as `hybrid perplexity` does), n_batch tokens an eval call, with every
    MoE layer's routing recorded (engine.observe_routing: a hybrid.engine.Engine) -> the ExpertTrace.
    progress(done, total) after each chunk."""
    rec = RoutingRecorder(engine.config.n_expert)
    with engine.observe_routing(rec):
        for i, chunk in enumerate(chunks):
            rec.chunk_index = i
            cache = engine.new_cache(len(chunk))
            for s in range(0, len(chunk), n_batch):
                engine.eval(list(chunk[s:s + n_batch]), cache)
            if progress is not None:
                progress(i + 1, len(chunks))
    return rec.trace(model)
