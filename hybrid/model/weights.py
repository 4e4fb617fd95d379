"""Model weights as zero-copy views into the GGUF mapping: matrices stay as raw quantized rows."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from gguf_io import GGUFFile, ModelConfig
from gguf_io.errors import GGUFFormatError

_BLK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Weight:
    """A weight tensor: `raw` is uint8 `(..., out, row_bytes)` for matrices, float32 for 1-D tensors."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order: (out, in) or (n_expert, out, in); (n,) for vectors
    raw: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def f32(self):
        """The values of a float32 tensor where they live (numpy or cupy): a matrix is held as raw bytes (uint8
        rows), viewed here as float32 (e.g. an expert bias tensor, (n_expert, n_out)); a vector already is."""
        return self.raw.view(np.float32) if self.raw.dtype == np.uint8 else self.raw

    def expert(self, e: int) -> "Weight":
        """The 2-D matrix of expert e of a 3-D expert tensor."""
        return Weight(f"{self.name}[{e}]", self.type_name, self.shape[1:], self.raw[e])


@dataclass
class ModelWeights:
    token_embd: Weight
    output: Weight  # token_embd itself when the output is tied
    output_norm: Weight
    layers: list[dict[str, Weight]] = field(default_factory=list)  # per layer: "attn_q", "attn_q.bias", ...

    def host_arrays(self) -> list[np.ndarray]:
        """The host arrays of every weight still on the CPU (GPU-resident ones are skipped)."""
        ws = [self.token_embd, self.output, self.output_norm, *(w for lw in self.layers for w in lw.values())]
        return [w.raw for w in ws if isinstance(w.raw, np.ndarray)]


def _weight(f: GGUFFile, name: str) -> Weight:
    info = f.tensors[name]
    data = f.tensor_data(name)
    if len(info.shape) == 1:
        if info.type_name != "F32":
            raise GGUFFormatError(f"tensor {name}: expected F32 for a 1-D tensor, found {info.type_name}")
        return Weight(name, info.type_name, info.shape, data)
    raw = data if data.dtype == np.uint8 else data.view(np.uint8)  # float matrices as raw rows too
    return Weight(name, info.type_name, info.shape, raw)


def load_weights(f: GGUFFile, config: ModelConfig) -> ModelWeights:
    """Collect every tensor the architecture uses; missing required tensors are a GGUFFormatError."""
    names = f.tensors
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in names:
            raise GGUFFormatError(f"tensor '{required}' is missing from the file")
    layers: list[dict[str, Weight]] = [dict() for _ in range(config.n_layer)]
    for name in names:
        m = _BLK.match(name)
        if not m:
            continue
        il = int(m.group(1))
        if config.n_layer <= il < config.n_layer + config.n_layer_nextn:
            continue  # a NextN/MTP block: llama.cpp's main graph does not run it, so it is not loaded
        if il >= config.n_layer:
            raise GGUFFormatError(f"tensor {name}: layer {il} but the model has {config.n_layer} layers")
        key = m.group(2) if m.group(3) == "weight" else f"{m.group(2)}.bias"
        layers[il][key] = _weight(f, name)
    token_embd = _weight(f, "token_embd.weight")
    output = _weight(f, "output.weight") if "output.weight" in names else token_embd
    return ModelWeights(token_embd, output, _weight(f, "output_norm.weight"), layers)


def check_layers(weights: ModelWeights, required: tuple[str, ...], arch: str) -> None:
    for il, lw in enumerate(weights.layers):
        missing = [r for r in required if r not in lw]
        if missing:
            raise GGUFFormatError(
                f"layer {il} lacks {', '.join(f'blk.{il}.{m}.weight' for m in missing)} needed by {arch}"
            )
