#!/usr/bin/env python3
"""Rewrite a GGUF with its matrices in another type, by our own reader and writer: a target for speculative
decoding with a draft model of the same vocabulary (the demo model drafting for its own Q8_0 or F16 copy).

    python3 scripts/requantize.py IN.gguf OUT.gguf --type Q8_0|F16|F32

Every tensor of two or more dimensions is dequantized (gguf_io's numpy decoders, exact) and written in --type
(Q8_0 by ggml's reference quantizer, gguf_io.quantize_ref); vectors (norms, biases) stay as they are. The metadata is
copied; general.file_type says the new type. Requantizing adds the new type's rounding to the old one's: the copy is
close to the original, not better than it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf_io import open_gguf, quant_spec  # noqa: E402
from gguf_io.metadata import U32  # noqa: E402
from gguf_io.quantize_ref import quantize_q8_0  # noqa: E402
from gguf_io.writer import TensorEntry, layout, write_gguf  # noqa: E402

FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # llama_ftype
ROWS_PER_CHUNK = 4096


def _encode(rows: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "F32":
        return rows.astype("<f4")
    if type_name == "F16":
        return rows.astype("<f2")
    return quantize_q8_0(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--type", default="Q8_0", type=str.upper, choices=list(FILE_TYPES))
    a = ap.parse_args()
    f = open_gguf(a.src)
    meta = [(k, v, f.metadata_types[k]) for k, v in f.metadata.items() if k != "general.file_type"]
    meta.append(("general.file_type", FILE_TYPES[a.type], U32))
    entries, sources = [], {}
    for info in f.tensors.values():
        new_type = a.type if len(info.ne) >= 2 else info.type_name
        entries.append(TensorEntry(info.name, tuple(info.ne), new_type))
        sources[info.name] = info

    def data(t: TensorEntry):
        info = sources[t.name]
        raw = f.tensor_data(t.name)
        if t.type_name == info.type_name:
            yield np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            return
        spec = quant_spec(info.type_name)
        rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
        for s in range(0, rows.shape[0], ROWS_PER_CHUNK):
            dense = np.asarray(spec.dequantize(rows[s : s + ROWS_PER_CHUNK]), dtype=np.float32)
            yield np.ascontiguousarray(_encode(dense.reshape(-1, info.ne[0]), t.type_name)).view(np.uint8).reshape(-1)

    size = write_gguf(a.out, layout(meta, entries), entries, data)
    print(f"{a.out}: {len(entries)} tensors, matrices in {a.type}, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
