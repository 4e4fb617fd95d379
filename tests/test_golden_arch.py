"""Golden tests: our next-token distributions on the synthetic llama/qwen2/qwen3/qwen3moe/glm4moe/deepseek2/gpt-oss
models vs llama.cpp's top-20 log-probs (tests/fixtures/arch, see its README for exactly what is scored), on the CPU
and (the second-round MoE architectures, marked gpu) with every layer on the GPU and split."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.generate.sampling import log_softmax

# (top-1 agreement >=, median KL <). The bounds were 0.995/1e-4 (llama-f16), 0.97/1e-3 (other f16),
# 0.88/1e-2 (dense q4_k_m), 0.75/5e-2 (moe). Our kernels quantize activations as llama.cpp's CPU backend does
# (Q8_0 / Q8_K / F16 vec_dot types), so we reach far closer agreement and hold ourselves to tighter bounds
# (measured: see docs/CORRECTNESS.md).
BOUNDS = {
    "llama-f16": (0.995, 1e-5),
    "qwen2-f16": (0.98, 1e-4),
    "qwen3-f16": (0.98, 1e-4),
    "qwen3moe-f16": (0.975, 1e-4),
    "llama-q4_k_m": (0.93, 5e-3),
    "qwen2-q4_k_m": (0.93, 5e-3),
    "qwen3-q4_k_m": (0.93, 5e-3),
    "qwen3moe-q4_k_m": (0.92, 5e-3),
    "qwen3moe-skew-q4_k": (0.92, 5e-3),
    # second round (measured on the CPU: see docs/CORRECTNESS.md). The float64 reference of the fixture README gets
    # 0.978 / 1.4e-4 (glm4moe-f16), 0.975 / 1.4e-4 (deepseek2-f16), 0.871 / 8.0e-3 and 0.836 / 1.0e-2 (q4_k_m):
    # sigmoid routing with a selection bias (and deepseek2's group limit) flips experts at more near ties.
    "glm4moe-f16": (0.98, 1e-4),
    "deepseek2-f16": (0.975, 1e-4),
    "glm4moe-q4_k_m": (0.92, 5e-3),
    "deepseek2-q4_k_m": (0.90, 5e-3),
    # gpt-oss (measured on the CPU: 0.976 / 3.5e-4 and 0.948 / 1.6e-3). The float64 reference gets 0.967 / 7.1e-4 and
    # 0.870 / 1.6e-2: the MXFP4 experts take Q8_0 activations and their inputs are large (the swiglu_oai clamps
    # bite), which our kernels reproduce and a float reference does not. There is no F16 gpt-oss file.
    "gpt-oss-mxfp4": (0.965, 1e-3),
    "gpt-oss-q4_k_m": (0.93, 5e-3),
}
# On the GPU (fp16 prefill GEMMs, q8_1 decode activations): the bounds test_gpu_moe holds the qwen3moe fixtures to.
GPU_BOUNDS = (0.75, 5e-2, 0.03)  # top-1 >=, median KL <, |PPL ratio - 1| <
GPU_FIXTURES = ("glm4moe-f16", "glm4moe-q4_k_m", "deepseek2-f16", "deepseek2-q4_k_m", "gpt-oss-mxfp4",
                "gpt-oss-q4_k_m")


def agreement(engine: Engine, ref, chunks: int | None = None,
              token_by_token: bool = False) -> tuple[float, np.ndarray, float]:
    """(top-1 agreement, KL per position, our PPL over the scored positions) for the first `chunks` (default: every)
    chunk of the reference; token_by_token: each chunk evaluated as decode steps (what a decode-only path, such as
    the GPU expert cache, serves) instead of one prompt."""
    tokens, pos = ref["tokens"], ref["positions"]
    top1, kls, nll = [], [], []
    for c in range(tokens.shape[0] if chunks is None else chunks):
        cache = engine.new_cache(int(ref["n_ctx"]))
        if token_by_token:
            logits = np.stack([engine.eval([int(t)], cache) for t in tokens[c]])
        else:
            logits = engine.eval(tokens[c], cache, logits_from=0)  # (128, n_vocab)
        lp = log_softmax(logits[pos])  # (63, n_vocab)
        ids, ref_lp = ref["top_ids"][c], ref["top_logprobs"][c].astype(np.float64)
        mine = np.take_along_axis(lp, ids, -1)
        p = np.exp(ref_lp - ref_lp.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        q = np.exp(mine - mine.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        kls.append((p * (np.log(p) - np.log(q))).sum(-1))
        top1.append(lp.argmax(-1) == ids[:, 0])
        nll.append(-lp[np.arange(len(pos)), ref["target_ids"][c]])
    return float(np.mean(np.concatenate(top1))), np.concatenate(kls), float(np.exp(np.mean(np.concatenate(nll))))


@pytest.mark.parametrize("name", list(BOUNDS))
def test_arch_fixture(fixtures_dir, name):
    gguf = fixtures_dir / "arch" / f"{name}.gguf"
    ref = np.load(fixtures_dir / "arch" / f"{name}.GPL-3.npz")
    engine = Engine.load(gguf, EngineParams(n_ctx=128, n_batch=128, n_ubatch=128))
    try:
        top1, kl, ppl = agreement(engine, ref)
    finally:
        engine.close()
    min_top1, max_kl = BOUNDS[name]
    assert np.all(np.isfinite(kl))
    assert top1 >= min_top1, f"{name}: top-1 agreement {top1:.3f} < {min_top1}"
    assert np.median(kl) < max_kl, f"{name}: median KL {np.median(kl):.2e} >= {max_kl}"
    # llama-perplexity on these settings (-c 128 -b 128 --chunks 16): the issue asks 1% (F16) / 5% (quantized);
    # we reach 0.05% / 0.6%, so 1% for all.
    tol = 0.01
    assert abs(ppl / float(ref["ppl"]) - 1) < tol, f"{name}: PPL {ppl:.1f} vs llama.cpp {float(ref['ppl']):.1f}"


@pytest.mark.gpu
@pytest.mark.parametrize("ngl", ["all", 3, "cpu-moe"])  # every layer, a split (the output layer and the last 2
# layers), and every layer with its routed experts in RAM (the gated routings routed on the host beside the GPU)
@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_arch_fixture_on_the_gpu(fixtures_dir, name, ngl):
    from hybrid.plan.overrides import build_overrides

    ref = np.load(fixtures_dir / "arch" / f"{name}.GPL-3.npz")
    moe_in_ram = ngl == "cpu-moe"
    if moe_in_ram and "f16" in name:
        pytest.skip("float experts have no CPU MoE kernel: they cannot stay in RAM beside a GPU layer")
    engine = Engine.load(fixtures_dir / "arch" / f"{name}.gguf",
                         EngineParams(n_ctx=128, n_batch=128, n_ubatch=128, op_offload=moe_in_ram,
                                      n_gpu_layers="all" if moe_in_ram else ngl,
                                      overrides=build_overrides((), moe_in_ram, 0)))
    try:
        top1, kl, ppl = agreement(engine, ref)
        # one decode step after a prefill agrees with the prefill's own logits (the decode path: CUDA graphs)
        tokens = ref["tokens"][0]
        cache = engine.new_cache(128)
        full = engine.eval(tokens[:65], cache, logits_from=0)
        cache = engine.new_cache(128)
        engine.eval(tokens[:64], cache)
        step = engine.eval(tokens[64:65], cache)
    finally:
        engine.close()
    print(f"{name} -ngl {ngl}: top-1 {top1:.4f}, median KL {np.median(kl):.2e}, PPL {ppl:.1f} vs "
          f"{float(ref['ppl']):.1f}")
    min_top1, max_kl, tol = GPU_BOUNDS
    assert np.all(np.isfinite(kl)) and top1 >= min_top1 and np.median(kl) < max_kl, (top1, np.median(kl))
    assert abs(ppl / float(ref["ppl"]) - 1) < tol, (ppl, float(ref["ppl"]))
    p, q = (np.exp(log_softmax(z[None])[0]) for z in (full[-1], step))
    assert float((p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum()) < 0.2  # q8 decode vs fp16 prefill


def test_perplexity_chunks_are_llama_cpp_s(fixtures_dir):
    """`hybrid perplexity -c 128 --chunks 16` evaluates exactly the token chunks llama-perplexity evaluated
    (so the PPL asserted above is the one the command prints)."""
    from gguf_io import open_gguf
    from hybrid.tools.perplexity import chunk_tokens
    from hybrid.text.tokenizer import Tokenizer

    raw = (fixtures_dir / "gemma-3-270m" / "gpl3.txt").read_bytes().decode("utf-8")
    with open_gguf(fixtures_dir / "arch" / "llama-f16.gguf") as f:
        tok = Tokenizer.from_metadata(f.metadata)
    assert len(tok.encode(raw)) == 8708  # the README's count for the file as it is, with BOS
    tokens = tok.encode(raw[:-1], add_special=True, parse_special=False)  # -f drops one trailing "\n"
    chunks = chunk_tokens(tokens, 128, tok.bos_id, 16)
    for name in BOUNDS:  # every model shares the llama-spm vocabulary and the same chunks
        ref = np.load(fixtures_dir / "arch" / f"{name}.GPL-3.npz")
        assert np.array_equal(np.array(chunks, dtype=np.int32), ref["tokens"]), name
