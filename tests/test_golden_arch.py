"""Golden tests: our next-token distributions on the synthetic llama/qwen2/qwen3/qwen3moe models vs llama.cpp's
top-20 log-probs (tests/fixtures/arch, see its README for exactly what is scored)."""

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
}


def agreement(engine: Engine, ref) -> tuple[float, np.ndarray, float]:
    """(top-1 agreement, KL per position, our PPL over the scored positions) for every chunk of the reference."""
    tokens, pos = ref["tokens"], ref["positions"]
    top1, kls, nll = [], [], []
    for c in range(tokens.shape[0]):
        cache = engine.new_cache(int(ref["n_ctx"]))
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
