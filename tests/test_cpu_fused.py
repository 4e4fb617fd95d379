"""CpuBackend's fused layers (hybrid/backends/cpu_fused.py, kernels_cpu/fused_layer.py) equal the op-by-op path of
blocks.layer_forward bit for bit: every architecture (MoE: its attention), KV type, quant mix, a sliding window and
batches large enough for the parallel forms of the norms, RoPE and the GLU; and they step aside where they have no
fused form (the float GEMM's batches, float weights, MoE FFNs)."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.model.arch.blocks import layer_forward
from hybrid.backends.cpu_fused import ffn_fusable, fusable
from hybrid.engine import Engine, EngineParams
from hybrid.tools.synth.model import make_model
from kernels_cpu.matmul import SMALL_BATCH_TOKENS
from kernels_cpu.norm import SERIAL_MAX_ELEMS


def _engine(tmp_path, arch, mix="Q4_K_M", n_embd=None, **kw) -> Engine:
    path = tmp_path / f"{arch}-{mix}.gguf"
    make_model(path, arch, "tiny", mix, seed=5, n_layer=2, head_dim=128 if arch == "qwen3" else None, n_embd=n_embd)
    return Engine.load(path, EngineParams(n_ctx=96, **kw))  # STEPS fill 80 cells


def _run(eng: Engine, fused: bool, steps: list[list[int]]) -> list[np.ndarray]:
    eng.cpu.fused = fused
    cache = eng.new_cache()
    return [np.asarray(eng.eval(tokens, cache)) for tokens in steps]


# a prompt of 12, a decode step, a batch of 40 (with 512-wide hidden states or qwen3's 128-wide heads, the norms
# and RoPE go past SERIAL_MAX_ELEMS to their parallel forms), a small batch, then decode past gemma3's 32-token
# window
BIG = 40
STEPS = [list(range(3, 15)), [7], list(range(20, 20 + BIG)), [9, 4, 11], *[[5 + i % 9] for i in range(24)]]


@pytest.mark.parametrize("arch, mix, kv, n_embd", [(*case, None) for case in [
    ("llama", "Q4_K_M", "f16"), ("qwen2", "Q4_K_M", "f16"), ("qwen3", "Q4_K_M", "q8_0"), ("gemma3", "Q4_K_M", "f16"),
    ("gemma3", "Q4_K_M", "q4_0"), ("llama", "Q5_0", "f16"), ("llama", "Q4_1", "f32"), ("qwen2", "Q6_K", "q8_0"),
    ("qwen3moe", "Q4_K_M", "f16"),
]] + [("llama", "Q4_K_M", "f16", 512), ("gemma3", "Q4_K_M", "q8_0", 512)])
def test_fused_equals_op_by_op(tmp_path, arch, mix, kv, n_embd):
    eng = _engine(tmp_path, arch, mix, n_embd, type_k=kv, type_v=kv)
    assert all(fusable(eng.spec, lw, 1) for lw in eng.weights.layers)
    if n_embd:  # these cases cover the parallel forms of the norms and RoPE (as in Llama 1B's 12-token prompt)
        assert BIG * eng.config.n_embd > SERIAL_MAX_ELEMS
    # step_args: attention_half's, once a layer, or a whole MoE layer call's (cpu_whole), once a step; ffn: a dense
    # FFN half; fused_layer: a whole MoE layer in one call
    calls = {"step_args": 0, "ffn": 0, "fused_layer": 0}

    def counted(obj, name):
        real = getattr(obj, name)

        def run(*a, **k):
            out = real(*a, **k)
            calls[name] += out is not None
            return out
        return run

    eng.cpu._fused.step_args, eng.cpu._fused.ffn = counted(eng.cpu._fused, "step_args"), counted(eng.cpu._fused, "ffn")
    eng.cpu.fused_layer = counted(eng.cpu, "fused_layer")
    fused = _run(eng, True, STEPS)
    n = len(STEPS) * eng.config.n_layer  # every layer of every step took the fused path
    moe = eng.spec.moe
    assert calls == {"step_args": len(STEPS) if moe else n, "ffn": 0 if moe else n, "fused_layer": n if moe else 0}
    plain = _run(eng, False, STEPS)
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert np.isfinite(a).all()
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


def test_fused_declines_where_it_has_no_form(tmp_path):
    moe = _engine(tmp_path, "qwen3moe")
    assert not any(ffn_fusable(moe.spec, lw) for lw in moe.weights.layers)
    f16 = _engine(tmp_path, "llama", "F16")
    assert not fusable(f16.spec, f16.weights.layers[0], 1)  # float weights: not an integer-dot type
    assert not ffn_fusable(f16.spec, f16.weights.layers[0])
    llama = _engine(tmp_path, "llama")
    lw = llama.weights.layers[0]
    assert fusable(llama.spec, lw, SMALL_BATCH_TOKENS - 1)
    assert not fusable(llama.spec, lw, SMALL_BATCH_TOKENS)  # larger batches go op by op (matmul's crossover), any host
    assert not fusable(llama.spec, lw, 0)
    x = np.zeros((1, llama.config.n_embd), dtype=np.float32)
    llama.cpu.fused = True
    with pytest.raises(ValueError, match="positions must lie in"):
        layer_forward(llama.cpu, llama.spec, llama.config, lw, 0, x, np.array([96], np.int32),
                      llama.new_cache(paged=False))
