"""kernels_gpu.unrepack and the GPU layers' repacked experts in RAM: the device puts the bytes of an uploaded
repacked run back in the file's layout exactly (against numpy's unrepack), and a gpt-oss model with its MXFP4
experts in RAM repacked gives the logits of the file's layout (prompt experts uploaded, decode on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from hybrid.backends.host_experts import EXPERT_TENSORS, dequantize_upload  # noqa: E402
from hybrid.backends.repack import LAYOUTS, byte_permutation, unrepack  # noqa: E402
from hybrid.engine import Engine, EngineParams  # noqa: E402
from hybrid.generate.sampling import log_softmax  # noqa: E402
from hybrid.plan.overrides import build_overrides  # noqa: E402
from kernels_gpu.matmul import dequantize  # noqa: E402
from kernels_gpu.unrepack import unrepack_x8  # noqa: E402
from test_gpu_moe import _kl  # noqa: E402

pytestmark = pytest.mark.gpu
TYPE_SIZE = {"Q4_0": 18, "MXFP4": 17}
KL_REPACKED = 1e-4  # decode: the CPU's repacked dots sum in another float order than the file layout's


@pytest.mark.parametrize("type_name", sorted(TYPE_SIZE))
@pytest.mark.parametrize("rows,blocks", [(8, 1), (40, 3), (2880, 90)])
def test_unrepack_on_the_device_equals_numpy(type_name, rows, blocks):
    rng = np.random.default_rng(rows + blocks)
    raw = rng.integers(0, 256, (rows, blocks * TYPE_SIZE[type_name]), dtype=np.uint8)
    packed = LAYOUTS[type_name][2](raw)
    got = unrepack_x8(cupy.asarray(packed), cupy.asarray(byte_permutation(type_name)), TYPE_SIZE[type_name]).get()
    assert np.array_equal(got, unrepack(packed, type_name))
    assert np.array_equal(got, raw)


@pytest.mark.parametrize("type_name", sorted(TYPE_SIZE))
def test_dequantized_upload_of_repacked_rows_equals_the_files(type_name):
    from hybrid.tools.synth.blocks import random_tensor  # noqa: PLC0415

    rows, n_in = 64, 2880
    raw = random_tensor(3, "x", type_name, rows * n_in, 0.05).reshape(rows, -1)
    want = dequantize(cupy.asarray(raw), type_name, dtype=np.float16).get()
    got = cupy.empty((rows, n_in), dtype=cupy.float16)
    dequantize_upload(cupy.asarray(LAYOUTS[type_name][2](raw)), f"{type_name}_X8", got, {})
    assert np.array_equal(got.get(), want)


def test_gpt_oss_repacked_experts_in_ram_match_the_file_layout(fixtures_dir):
    """--cpu-moe: a 96-token prompt (its experts uploaded: >= 64 tokens) and 6 decode tokens (experts on the CPU),
    with the MXFP4 experts repacked (the default) and as in the file (--no-repack)."""
    path = fixtures_dir / "arch" / "gpt-oss-mxfp4.gguf"
    seq = np.random.default_rng(4).integers(3, 1000, 96)
    seq[0] = 1
    out, dec = {}, {}
    for repack in (True, False):
        eng = Engine.load(path, EngineParams(n_ctx=128, n_batch=96, n_ubatch=96, n_gpu_layers="all", repack=repack,
                                             op_offload=True, overrides=build_overrides((), True, 0)))
        try:
            types = {lw[n].type_name for lw in eng.weights.layers for n in EXPERT_TENSORS}
            assert types == ({"MXFP4_X8"} if repack else {"MXFP4"}), types
            cache = eng.new_cache()
            out[repack] = log_softmax(eng.eval(seq, cache, logits_from=0))
            gpus = {id(b): b for b in (*eng.backends, eng.output_backend) if hasattr(b, "host_experts")}.values()
            assert sum(b.host_experts.stats.gpu_batches for b in gpus) > 0
            rows = []
            for tok in (5, 17, 99, 250, 3, 41):
                rows.append(log_softmax(eng.eval([tok], cache)[-1:]))
            dec[repack] = np.concatenate(rows)
            assert sum(b.host_experts.stats.cpu_batches for b in gpus) > 0
        finally:
            eng.close()
    assert np.array_equal(out[True], out[False])  # the same bytes, uploaded and dequantized alike
    kl = _kl(dec[False], dec[True])
    print(f"gpt-oss --cpu-moe decode, repacked experts vs the file's layout: max KL {kl.max():.2e}")
    assert kl.max() < KL_REPACKED
