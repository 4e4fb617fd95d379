"""`hybrid bench --batched`: llama-batched-bench's table (tools/bench_batched.py measures)."""

from __future__ import annotations

from dataclasses import replace

import typer

from hybrid.engine.params import EngineParams
from hybrid.tools.bench_batched import markdown, run_batched, table_row

from hybrid.cli.session import load_engine, note


def bench_batched(model: str, params: EngineParams, pps: list[int], tgs: list[int], bs: list[int]) -> None:
    """Load once, then print a row per (PP, TG, B) as it is measured."""
    if not pps or not tgs or not bs or min(pps) < 0 or min(tgs) < 0 or min(bs) < 1 or max(pps) + max(tgs) < 1:
        raise typer.BadParameter("--batched needs -npp and -ntg counts >= 0 (not all 0) and -npl counts >= 1")
    n_ctx = max(bs) * (max(pps) + max(tgs))  # what the plan reserves KV for: every sequence at its longest
    engine, _ = load_engine(model, replace(params, n_ctx=max(n_ctx, 16)), warn_ctx=False)
    import numba  # noqa: PLC0415 - the thread count in effect

    p = engine.params
    note(f"n_batch = {p.n_batch}, n_ubatch = {p.n_ubatch}, n_threads = {numba.get_num_threads()}, "
         f"type_k = {p.type_k}, type_v = {p.type_v}; one KV cache per sequence")
    rows: list[tuple[str, ...]] = []
    try:
        for r in run_batched(engine, pps, tgs, bs, p.n_batch):
            rows.append(table_row(r))
            note(f"PP {r.pp}, TG {r.tg}, B {r.b}: S_PP {r.s_pp:.2f} t/s, S_TG {r.s_tg:.2f} t/s")
        if engine.op_offload is not None:  # how the CPU layers ran: batches streamed, decode sizes decided
            note(f"op offload: {engine.op_offload.describe()}")
    finally:
        engine.close()
    markdown(rows, print)
