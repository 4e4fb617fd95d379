"""The KV cache type table (gguf_io.kv_types) against gguf-py's type sizes, and the kernels' codes against it."""

import re
from pathlib import Path

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

import kernels_cpu.kv_cache as cpu_kv
import kernels_gpu.kv_cache as gpu_kv  # imports without cupy: cupy is loaded inside its functions
from gguf_io.errors import HybridError, UnsupportedKVType
from gguf_io.kv_types import KV_TYPES, KVType, kv_row_bytes, kv_type

ROOT = Path(__file__).resolve().parents[1]
CODES = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}  # kv.cu, attention.cu and the Numba kernels branch on these


def test_table_order_and_codes():
    assert list(KV_TYPES) == ["f16", "q8_0", "q4_0", "f32"]  # the order messages and -ctk help list them
    assert {name: t.code for name, t in KV_TYPES.items()} == CODES
    assert all(isinstance(t, KVType) and t.name == name for name, t in KV_TYPES.items())


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_block_sizes_are_ggmls(name):
    t = KV_TYPES[name]
    assert (t.block, t.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_kernels_agree_with_the_table(name):
    t = KV_TYPES[name]
    assert cpu_kv.kv_type_code(name) == gpu_kv.kv_type_code(name.upper()) == t.code
    assert cpu_kv.kv_row_bytes(name, 256) == gpu_kv.kv_row_bytes(name, 256) == 256 // t.block * t.block_bytes
    assert cpu_kv.alloc_kv_layer(3, 2, 64, 128, name, name).k.shape == (3, 2, kv_row_bytes(name, 64))


def test_kernel_constants_come_from_the_table():
    assert cpu_kv.QK == KV_TYPES["q8_0"].block == KV_TYPES["q4_0"].block
    assert (cpu_kv.Q8_0_BYTES, cpu_kv.Q4_0_BYTES) == (KV_TYPES["q8_0"].block_bytes, KV_TYPES["q4_0"].block_bytes)


def test_cuda_sources_use_the_table():
    # the .cu files cannot import the table: pin the codes their comments document and the block sizes they use
    att = (ROOT / "kernels_gpu" / "attention.cu").read_text(encoding="utf-8")
    assert "code 0 f32, 1 f16, 2 q8_0, 3 q4_0" in att
    kv = (ROOT / "kernels_gpu" / "kv.cu").read_text(encoding="utf-8")
    assert "code 2 = q8_0, 3 = q4_0" in kv
    for name in ("q8_0", "q4_0"):
        assert re.search(rf"row \* \(nb \* {KV_TYPES[name].block_bytes}\)", kv), name


def test_lookup_and_errors():
    assert kv_type("Q8_0") is KV_TYPES["q8_0"]
    with pytest.raises(UnsupportedKVType, match=r"^KV cache type must be one of f16, q8_0, q4_0, f32, found 'bf16'$"):
        kv_type("bf16")  # ggml has it, the kernels do not store it
    with pytest.raises(ValueError, match="found 'q5_0'"):
        cpu_kv.kv_type_code("q5_0")
    with pytest.raises(HybridError, match=r"^a q8_0 KV cache needs a head size divisible by 32, found 40$"):
        kv_row_bytes("q8_0", 40)
    assert kv_row_bytes("f16", 40) == 80 and kv_row_bytes("q4_0", 64) == 36 and kv_row_bytes("f32", 3) == 12
