"""`hybrid trace-experts`: the experts every MoE layer routes each token of a text to, saved as an .npz trace
(hybrid/backends/moe_cache/trace.py has the format), and the routing's per-layer summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from hybrid.backends.moe_cache.runtime import expert_cache
from hybrid.backends.moe_cache.stats import RoutingSummary, routing_summary
from hybrid.backends.moe_cache.trace import record_trace
from hybrid.engine.params import EngineParams
from hybrid.errors import HybridError
from hybrid.tools.perplexity import chunk_tokens

from hybrid.cli.options import LOAD_FLAGS, ModelArgument, ModelOpt, engine_flags
from hybrid.cli.session import load_engine, note, read_text_file


@engine_flags(*LOAD_FLAGS, ctx=512)
def trace_experts(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,  # merged into `model` while the flags are parsed
    file: Annotated[str, typer.Option("-f", "--file", help="The text to evaluate.")] = ...,
    output: Annotated[Path, typer.Option("-o", "--output", help="The trace file to write (.npz).")] = ...,
    chunks: Annotated[int, typer.Option("--chunks", help="Evaluate at most this many chunks (-1 = all).")] = -1,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
    params: EngineParams = EngineParams(),
) -> None:
    """Record the experts (ids and weights) each MoE layer selects for every token of a text, evaluated in chunks
    of -c tokens as `hybrid perplexity` does, on any placement; print per-layer routing statistics."""
    if model is None:
        raise typer.BadParameter("trace-experts needs a mixture-of-experts model (MODEL or -m)")
    text = read_text_file(file)
    engine, _ = load_engine(model, params)
    try:
        cfg = engine.config
        if not cfg.n_expert:
            raise HybridError(f"{model}: a {cfg.arch} model without routed experts: nothing to trace")
        ctx, tok = engine.params.n_ctx, engine.tokenizer
        tokens = tok.encode(text, add_special=True, parse_special=False)
        chunk_list = chunk_tokens(tokens, ctx, tok.bos_id if tok.add_bos else None, chunks)
        note(f"trace-experts: {len(tokens)} tokens, {len(chunk_list)} chunks of {ctx}")
        name = str(engine.gguf.metadata.get("general.name", "")) or Path(engine.gguf.path).stem
        cache = expert_cache(engine)
        marks = []  # (tokens evaluated, the cache's decode hits, lookups) after each chunk

        def progress(done: int, total: int) -> None:
            typer.echo(f"[{done}/{total}]", nl=done == total, err=True)
            if cache is not None:
                st = cache.book.stats
                marks.append((sum(len(c) for c in chunk_list[:done]), int(st.hits.sum()), int(st.lookups.sum())))

        trace = record_trace(engine, chunk_list, name, engine.params.n_batch, progress)
        measured = None if cache is None else cache_hit_rates(cache.book, marks)
    finally:
        engine.close()
    trace.save(output)
    summary = routing_summary(trace)
    if json_out:
        print(json.dumps({"output": str(output), **summary.to_json(),
                          **({} if measured is None else {"moe_cache": measured})}))
        return
    note(f"wrote {output}: {trace.n_tok} tokens x {len(trace.layers)} MoE layers x {trace.top_k} experts")
    if measured is not None:
        note(measured["summary"])
        if measured["second_half_hit_rate"] is not None:
            note(f"moe cache: decode hit rate {measured['second_half_hit_rate']:.1%} over the second half of the "
                 f"tokens (what scripts/sim_expert_cache.py scores)")
    _render(summary)


def cache_hit_rates(book, marks: list[tuple[int, int, int]]) -> dict:
    """The expert cache's counts during a trace: its summary line, the decode hit rate overall and over the tokens
    after the chunk boundary at half the tokens (None when no chunk ends there), as the simulator splits a trace."""
    st = book.stats
    half = marks[-1][0] // 2 if marks else 0
    at = next(((h, n) for t, h, n in marks if t == half), None)
    second = None
    if at is not None and int(st.lookups.sum()) > at[1]:
        second = (int(st.hits.sum()) - at[0]) / (int(st.lookups.sum()) - at[1])
    return {"summary": book.summary(), "slots": book.n_slots, "hit_rate": st.hit_rate,
            "second_half_hit_rate": second}


def _render(s: RoutingSummary) -> None:
    t = Table(title=f"{s.model}: routing of {s.n_tok} tokens, top {s.top_k} of {s.n_expert} experts")
    t.add_column("layer", justify="right")
    for c in s.cs:
        t.add_column(f"top-{c} share", justify="right")
    t.add_column("entropy (bits)", justify="right")
    t.add_column("/ log2 n", justify="right")
    t.add_column("busiest experts (slots)")
    for lr in s.layers:
        t.add_row(str(lr.layer), *(f"{x:.3f}" for x in lr.shares), f"{lr.entropy_bits:.2f}", f"{lr.entropy_norm:.3f}",
                  " ".join(f"{e}:{n}" for e, n in lr.busiest))
    t.add_section()
    t.add_row("all", *(f"{x:.3f}" for x in s.mean_shares), f"{s.mean_entropy_bits:.2f}", f"{s.mean_entropy_norm:.3f}",
              "(means over the layers)")
    Console().print(t)
