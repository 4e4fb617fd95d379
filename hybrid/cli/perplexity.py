"""`hybrid perplexity`: llama-perplexity's chunking and scoring over a text file."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from hybrid.engine.engine import EngineParams
from hybrid.tools.perplexity import chunk_tokens, perplexity as run_perplexity

from hybrid.cli.common import ModelArg
from hybrid.cli.options import (BatchOpt, CpuMaskOpt, CpuRangeOpt, CtkOpt, CtvOpt, CtxOpt, MlockOpt, NglOpt, NoMmapOpt,
                      NoOpOffloadOpt, NoRepackOpt, NumaOpt, ThreadsOpt, UBatchOpt)
from hybrid.cli.session import load_engine, note, system_params


def perplexity(
    model: ModelArg = None,
    file: Annotated[str, typer.Option("-f", "--file", help="The text to score.")] = ...,
    ctx: CtxOpt = 512,
    batch: BatchOpt = 2048,
    ubatch: UBatchOpt = 512,
    chunks: Annotated[int, typer.Option("--chunks", help="Score at most this many chunks (-1 = all).")] = -1,
    threads: ThreadsOpt = 0,
    ctk: CtkOpt = "f16",
    ctv: CtvOpt = "f16",
    ngl: NglOpt = "0",
    numa: NumaOpt = None,
    mlock: MlockOpt = False,
    no_mmap: NoMmapOpt = False,
    no_op_offload: NoOpOffloadOpt = False,
    no_repack: NoRepackOpt = False,
    cpu_mask: CpuMaskOpt = None,
    cpu_range: CpuRangeOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with ppl, ppl_stderr, running values.")] = False,
) -> None:
    """Perplexity of a text, as llama-perplexity computes it: chunks of -c tokens, each from an empty cache with
    its first token replaced by BOS, the second half of each chunk scored."""
    with open(file, "rb") as fh:
        raw = fh.read()
    text = raw.decode("utf-8", errors="replace")
    if text.endswith("\n"):
        text = text[:-1]  # llama.cpp's -f drops one trailing newline
    engine, _ = load_engine(model, EngineParams(ctx, max(batch, ctx), min(ubatch, max(batch, ctx)), ctk, ctv, threads,
                                                   **system_params(numa, mlock, no_mmap, cpu_mask, cpu_range,
                                                                   no_op_offload, no_repack)), ngl)
    tok = engine.tokenizer
    tokens = tok.encode(text, add_special=True, parse_special=False)
    chunk_list = chunk_tokens(tokens, ctx, tok.bos_id, chunks)
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
