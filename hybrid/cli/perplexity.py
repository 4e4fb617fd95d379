"""`hybrid perplexity`: llama-perplexity's chunking and scoring over a text file."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated

import typer

from hybrid.engine.params import EngineParams
from hybrid.tools.perplexity import chunk_tokens, perplexity as run_perplexity

from hybrid.cli.options import LOAD_FLAGS, ModelArgument, ModelOpt, engine_flags
from hybrid.cli.session import load_engine, note, read_text_file


@engine_flags(*LOAD_FLAGS, ctx=512)
def perplexity(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,  # merged into `model` while the flags are parsed
    file: Annotated[str, typer.Option("-f", "--file", help="The text to score.")] = ...,
    chunks: Annotated[int, typer.Option("--chunks", help="Score at most this many chunks (-1 = all).")] = -1,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with ppl, ppl_stderr, running values.")] = False,
    params: EngineParams = EngineParams(),
) -> None:
    """Perplexity of a text, as llama-perplexity computes it: chunks of -c tokens, each from an empty cache with
    its first token replaced by BOS (for a model that adds BOS), the second half of each chunk scored."""
    text = read_text_file(file)  # as `run -f` reads it: one trailing newline dropped, non-UTF-8 bytes as U+FFFD
    batch = max(params.n_batch, params.n_ctx)  # a chunk is one eval call, as llama-perplexity's n_batch >= n_ctx
    engine, _ = load_engine(model, replace(params, n_batch=batch, n_ubatch=min(params.n_ubatch, batch)))
    ctx = engine.params.n_ctx  # -c 0: the model's training context
    tok = engine.tokenizer
    tokens = tok.encode(text, add_special=True, parse_special=False)
    chunk_list = chunk_tokens(tokens, ctx, tok.bos_id if tok.add_bos else None, chunks)
    if not json_out:
        note(f"perplexity: {len(tokens)} tokens, {len(chunk_list)} chunks of {ctx}")

    def logits_of(chunk: list[int], first: int):
        cache = engine.new_cache(ctx)
        return engine.eval(chunk, cache, logits_from=first)

    running = []
    last = None
    for step in run_perplexity(chunk_list, tokens, ctx, logits_of):
        running.append(step.ppl)
        last = step
        if not json_out:
            typer.echo(f"[{step.chunk + 1}]{step.ppl:.4f},", nl=False)
    if json_out:
        print(json.dumps({"ppl": last.ppl, "ppl_stderr": last.ppl_err, "n_chunks": len(chunk_list), "n_ctx": ctx,
                          "n_tokens": len(tokens), "running_ppl": running}))
    else:
        typer.echo(f"\nFinal estimate: PPL = {last.ppl:.4f} +/- {last.ppl_err:.5f}")
