"""Damaged GGUF files: truncations, byte flips, field overwrites and splices may only ever raise GGUFFormatError.

A file that still parses must be fully usable: every tensor view readable, the config built or refused with a
HybridError. Seeds are fixed, so a failure reproduces; the failing case's seed/offset is in the assertion.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_io import GGUFFormatError, HybridError, ModelConfig, open_gguf
from gguf_factory import VT, Tensor, Typed, build_gguf, sample_metadata, tiny_model

INTERESTING_U64 = [0, 1, 2, 3, 4, 5, 7, 8, 31, 32, 33, 64, 255, 256, 4096, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
                   2**63, 2**64 - 1]


def _base():
    md = sample_metadata()
    md["tokenizer.ggml.tokens"] = ["<unk>", "a", "bb", "\u00e9"]
    md["tokenizer.ggml.scores"] = Typed(VT.ARRAY, [0.0, -1.0, -2.0, -3.0], VT.F32)
    tensors = [Tensor("token_embd.weight", (32, 4), "Q8_0"), Tensor("blk.0.attn_q.weight", (256, 2), "Q4_K"),
               Tensor("output_norm.weight", (32,), "F32"), Tensor("blk.0.ffn_up_exps.weight", (16, 2, 2), "F16")]
    return build_gguf(md, tensors)


BASE = _base()
MODEL = build_gguf(*tiny_model("qwen3", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_vocab=8))


class Opener:
    """Writes each case to a fresh inode (os.replace) so that no live mapping ever sees its file shrink."""

    def __init__(self, root: Path):
        self.root, self.n = root, 0

    def check(self, data: bytes, case: str) -> bool:
        """True when the file parsed; any exception other than GGUFFormatError fails the test."""
        self.n += 1
        tmp, path = self.root / "case.tmp", self.root / "case.gguf"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        try:
            f = open_gguf(path)
        except GGUFFormatError as exc:
            assert "\n" not in str(exc), case
            return False
        except Exception as exc:  # noqa: BLE001 - this is what the test looks for
            raise AssertionError(f"{case}: {type(exc).__name__} escaped: {exc}") from exc
        try:  # a file that parses must be usable
            for name in f.tensors:
                v = f.tensor_data(name)
                if v.size:
                    v.reshape(-1)[[0, -1]].tobytes()
            try:
                ModelConfig.from_gguf(f)
            except HybridError:
                pass
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"{case}: parsed, then {type(exc).__name__}: {exc}") from exc
        return True


@pytest.fixture
def opener(tmp_path):
    return Opener(tmp_path)


def test_base_files_are_valid(opener):
    assert opener.check(BASE.data, "base")
    assert opener.check(MODEL.data, "model")


@pytest.mark.parametrize("lay", [BASE, MODEL], ids=["sample", "model"])
def test_every_truncation(opener, lay):
    header_end = lay.offsets["data"]
    cuts = list(range(header_end + 1)) + sorted({v for k, v in lay.offsets.items() if k.startswith("tensor:")})
    cuts += [lay.offsets["end"] - 1]
    parsed = [c for c in cuts if opener.check(lay.data[:c], f"truncated at {c}")]
    # with no padding after the infos a cut at the data start may parse (0 tensors can't), never earlier ones
    assert all(c >= lay.offsets["tensor_infos_end"] for c in parsed)


def test_field_overwrites(opener):
    """Every count, length, type and offset field set to boundary values."""
    lay = BASE
    fields = [lay.offsets["n_tensors"], lay.offsets["n_kv"]]
    for key, off in lay.offsets.items():
        if key.startswith(("kv:", "value:")):
            fields += [off, off + 4, off + 8]  # the length / the type, then an array's element type or count
        if key.startswith("tensor_info:"):
            name_len = struct.unpack_from("<Q", lay.data, off)[0]
            p = off + 8 + name_len
            fields += [off, p] + [p + 4 + 8 * i for i in range(4)]
    for off in sorted(set(fields)):
        for fmt in ("<Q", "<I"):
            for v in INTERESTING_U64:
                if fmt == "<I" and v >= 2**32:
                    continue
                b = bytearray(lay.data)
                if off + struct.calcsize(fmt) <= len(b):
                    struct.pack_into(fmt, b, off, v)
                    opener.check(bytes(b), f"{fmt} {v} at {off}")
    assert opener.n > 1000


@pytest.mark.parametrize("seed", range(4))
def test_random_byte_flips(opener, seed):
    rng = random.Random(seed)
    src = BASE if seed % 2 == 0 else MODEL
    header_end = src.offsets["data"]
    for i in range(400):
        b = bytearray(src.data)
        for _ in range(rng.choice((1, 1, 2, 3, 8))):
            pos = rng.randrange(header_end) if rng.random() < 0.9 else rng.randrange(len(b))
            b[pos] = rng.randrange(256) if rng.random() < 0.7 else b[pos] ^ (1 << rng.randrange(8))
        opener.check(bytes(b), f"seed {seed} case {i}")


@pytest.mark.parametrize("seed", range(2))
def test_random_splices(opener, seed):
    rng = random.Random(100 + seed)
    for i in range(300):
        a, other = (BASE.data, MODEL.data) if rng.random() < 0.5 else (MODEL.data, BASE.data)
        hdr = min(len(a), 1200)
        x, y = sorted(rng.randrange(hdr) for _ in range(2))
        kind = rng.randrange(4)
        if kind == 0:  # delete a chunk
            data = a[:x] + a[y:]
        elif kind == 1:  # duplicate a chunk in place
            data = a[:y] + a[x:y] + a[y:]
        elif kind == 2:  # move a chunk elsewhere
            z = rng.randrange(hdr)
            chunk, rest = a[x:y], a[:x] + a[y:]
            data = rest[:z] + chunk + rest[z:]
        else:  # the head of one file on the tail of the other
            data = a[:x] + other[rng.randrange(min(len(other), 1200)):]
        opener.check(data, f"seed {seed} splice {i} kind {kind} ({x}, {y})")


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    edits=st.lists(st.tuples(st.integers(0, BASE.offsets["data"] - 1), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(BASE.data))),
    insert=st.one_of(st.none(), st.tuples(st.integers(0, BASE.offsets["data"]), st.binary(max_size=16))),
)
def test_hypothesis_mutations(tmp_path_factory, edits, cut, insert):
    b = bytearray(BASE.data)
    for pos, val in edits:
        b[pos] = val
    if insert is not None:
        b[insert[0] : insert[0]] = insert[1]
    if cut is not None:
        del b[cut:]
    Opener(tmp_path_factory.getbasetemp()).check(bytes(b), f"edits={edits} cut={cut} insert={insert}")


def test_huge_claims_do_not_allocate(opener):
    """Counts near 2**64 are refused before anything is allocated for them."""
    arr = build_gguf({"a": Typed(VT.ARRAY, np.zeros(4, np.float64).tolist(), VT.F64)})
    at = arr.offsets["value:a"] + 8
    for v in (2**61, 2**63, 2**64 - 1):
        b = bytearray(arr.data)
        struct.pack_into("<Q", b, at, v)
        assert not opener.check(bytes(b), f"count {v}")
