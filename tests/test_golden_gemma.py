"""Golden tests on the demo model (Gemma 3 270M Q4_K_M) against llama.cpp's own outputs:
greedy.json (tokens, top-5, log-probs) and perplexity.json (llama-perplexity on gpl3.txt)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.perplexity import chunk_tokens, perplexity
from hybrid.sampling import log_softmax

TOP5_MIN_OVERLAP = 4  # of 5, at every step of the agreed prefix
TOP1_LOGPROB_TOL = 0.15  # |ours - llama.cpp's| log-prob of the top token
PPL_REL_TOL = 0.01


@pytest.fixture(scope="module")
def engine(demo_model):
    e = Engine.load(demo_model, EngineParams(n_ctx=2048, n_batch=2048, n_ubatch=512))
    yield e
    e.close()


def greedy_run(engine: Engine, prompt_ids: list[int], n_steps: int):
    """Greedy decode; returns our ids and the log-softmax rows at each step."""
    cache = engine.new_cache(512)
    logits = engine.eval(prompt_ids, cache)
    ids, rows = [], []
    for _ in range(n_steps):
        lp = log_softmax(logits)
        tok = int(np.argmax(lp))
        ids.append(tok)
        rows.append(lp)
        logits = engine.eval([tok], cache)
    return ids, rows


def test_greedy_matches_llama_cpp(engine, fixtures_dir):
    cases = json.loads((fixtures_dir / "gemma-3-270m" / "greedy.json").read_text())["cases"]
    report = []
    for case in cases:
        ours = engine.tokenizer.encode(case["prompt"], add_special=True, parse_special=True)
        assert ours == case["prompt_ids"], f"{case['name']}: prompt tokenization differs"
        n_ref = len(case["generated_ids"])
        ids, rows = greedy_run(engine, case["prompt_ids"], n_ref)
        agreed = case["agreed_prefix_len"]
        assert ids[:agreed] == case["generated_ids"][:agreed], f"{case['name']}: greedy ids differ within the agreed prefix"
        for step in range(agreed):
            ref_top = case["steps"][step]["top"]
            ours_top5 = set(np.argsort(-rows[step])[:5].tolist())
            overlap = len(ours_top5 & {t["id"] for t in ref_top})
            assert overlap >= TOP5_MIN_OVERLAP, f"{case['name']} step {step}: top-5 overlap {overlap}"
            d = abs(rows[step][ref_top[0]["id"]] - ref_top[0]["logprob"])
            assert d < TOP1_LOGPROB_TOL, f"{case['name']} step {step}: top-1 log-prob off by {d:.3f}"
        same = next((i for i, (a, b) in enumerate(zip(ids, case["generated_ids"])) if a != b), n_ref)
        report.append((case["name"], agreed, same, n_ref))
    print("\n(case, agreed prefix, we agree for, generated):", report)


def test_perplexity_matches_llama_cpp(engine, fixtures_dir):
    ref = json.loads((fixtures_dir / "gemma-3-270m" / "perplexity.json").read_text())
    run = next(r for r in ref["runs"] if r["n_ctx"] == 128 and r["n_seq"] == 1)  # one chunk per batch, like ours
    text = (fixtures_dir / "gemma-3-270m" / "gpl3.txt").read_bytes().decode("utf-8")
    text = text[:-1] if text.endswith("\n") else text
    tokens = engine.tokenizer.encode(text, add_special=True, parse_special=False)
    assert len(tokens) == ref["texts"]["gpl3"]["n_tokens_with_bos"]
    n_ctx = run["n_ctx"]
    chunks = chunk_tokens(tokens, n_ctx, engine.tokenizer.bos_id)
    assert len(chunks) == run["n_chunks"]
    steps = list(perplexity(chunks, tokens, n_ctx,
                            lambda c, first: engine.eval(c, engine.new_cache(n_ctx), logits_from=first)))
    ppl = steps[-1].ppl
    assert abs(ppl / run["ppl"] - 1) < PPL_REL_TOL, f"PPL {ppl:.4f} vs llama.cpp {run['ppl']}"
    running = np.array([s.ppl for s in steps])
    assert np.max(np.abs(running / np.array(run["running_ppl_after_each_chunk"]) - 1)) < 0.02
