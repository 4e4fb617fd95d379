"""`hybrid tokenize`: text to token ids and pieces, like llama-tokenize."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from hybrid.text.tokenizer import Tokenizer

from hybrid.cli.common import JsonOpt, open_model
from hybrid.cli.options import ModelArgument, ModelOpt
from hybrid.cli.session import clean_text


def tokenize(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,  # merged into `model` while the flags are parsed
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="The text to tokenize.")] = ...,
    ids: Annotated[bool, typer.Option("--ids", help="Print only the ids, as a Python list (like llama-tokenize --ids).")] = False,
    no_bos: Annotated[bool, typer.Option("--no-bos", help="Do not add the BOS token even if the model asks for it.")] = False,
    no_parse_special: Annotated[
        bool, typer.Option("--no-parse-special", help="Treat text such as <start_of_turn> as plain text.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Tokenize TEXT with the model's own vocabulary (special tokens in the text are parsed, as llama.cpp does)."""
    with open_model(model) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    token_ids = tok.encode(clean_text(prompt), add_special=not no_bos, parse_special=not no_parse_special)
    pieces = [tok.piece(i) for i in token_ids]
    if json_out:
        print(json.dumps({"ids": token_ids, "pieces": pieces}, ensure_ascii=False))
    elif ids:
        print(token_ids)
    else:
        for i, p in zip(token_ids, pieces):
            print(f"{i:6d} -> '{p}'")
