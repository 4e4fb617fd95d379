"""The other routes: /health, /v1/models, /props, /tokenize, /detokenize, /apply-template, /metrics and the chat
page at /."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse

from hybrid.server import metrics as M
from hybrid.server.prompt import render_chat
from hybrid.server.responses import error_body
from hybrid.server.routes import read_json
from hybrid.server.schemas import BadRequest, parse_chat


async def health(request: Request):
    state = request.app.state.server
    if not state.ready:
        return JSONResponse(error_body("Loading model", "unavailable_error", code=503), status_code=503)
    return JSONResponse({"status": "ok"})


async def models(request: Request):
    state = request.app.state.server
    e = state.engine
    meta = {"n_ctx": state.n_ctx, "n_ctx_train": e.config.n_ctx_train,
            "n_vocab": e.tokenizer.n_vocab, "n_embd": e.config.n_embd}
    return JSONResponse({"object": "list", "data": [{"id": state.config.alias, "object": "model",
                                                     "created": state.created, "owned_by": "hybrid", "meta": meta}]})


async def props(request: Request):
    state = request.app.state.server
    return JSONResponse({"model_alias": state.config.alias, "total_slots": state.config.n_parallel,
                         "n_ctx": state.n_ctx, "chat_template": state.template.source,
                         "reasoning_format": state.config.reasoning_format})


async def tokenize(request: Request):
    state = request.app.state.server
    body = await read_json(request, state.config.max_body)
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", "content")
    flags = {k: body.get(k, d) for k, d in (("add_special", False), ("parse_special", True), ("with_pieces", False))}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise BadRequest(f"'{k}' must be a boolean", k)
    tok = state.engine.tokenizer
    ids = tok.encode(content, add_special=flags["add_special"], parse_special=flags["parse_special"])
    if flags["with_pieces"]:
        return JSONResponse({"tokens": [{"id": i, "piece": tok.piece(i)} for i in ids]})
    return JSONResponse({"tokens": ids})


async def detokenize(request: Request):
    state = request.app.state.server
    body = await read_json(request, state.config.max_body)
    ids = body.get("tokens") if isinstance(body, dict) else None
    tok = state.engine.tokenizer
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("'tokens' must be an array of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < tok.n_vocab]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {tok.n_vocab})", "tokens")
    return JSONResponse({"content": tok.decode(ids)})


async def apply_template(request: Request):
    """llama-server's /apply-template: the prompt text a chat request's messages (and tools) render to."""
    state = request.app.state.server
    req = parse_chat(await read_json(request, state.config.max_body))
    return JSONResponse({"prompt": render_chat(state, req)})


async def metrics(request: Request):
    state = request.app.state.server
    pc = state.prompt_cache
    sched = state.scheduler
    pcs = [s.pc for s in sched.slots] if sched is not None else ([] if pc is None else [pc])
    gauges = {
        "requests_processing": (state.slots.running, "Generations running in the slots."),
        "requests_deferred": (state.slots.waiting, "Requests waiting for a free slot."),
        "slots_total": (state.config.n_parallel, "Generation slots (-np)."),
        "slots_busy": (len(sched.running) if sched is not None else state.slots.running,
                       "Slots running a generation (the rest are in the free pool)."),
        "kv_cache_busy_cells": (sched.busy_cells if sched is not None else
                                (pc.cache.n_past if pc and state.slots.running else 0),
                                "KV cells held by running generations."),
        "kv_cache_tokens": (sum(p.cache.n_past for p in pcs), "Tokens the slots' KV caches hold (kept for reuse)."),
        "n_ctx": (state.n_ctx if state.ready else 0, "A slot's context size in tokens."),
        "prompt_cache_ram_bytes": (sum(p.saved_bytes for p in pcs), "Host RAM held by saved prompt states."),
        "prompt_cache_ram_limit_bytes": (state.config.cache_ram, "The --cache-ram bound."),
        "prompt_cache_entries": (sum(len(p.saved) for p in pcs), "Saved prompt states."),
    }
    if sched is not None:  # -np > 1: prompt tokens the slots' caches spared, and those copied between slots
        gauges["prompt_tokens_reused"] = (sched.reused_tokens, "Prompt tokens taken from a cache, not evaluated.")
        gauges["prompt_tokens_copied"] = (sched.copied_tokens, "Of those, K/V rows copied from another slot.")
        gauges["prompt_tokens_evaluated"] = (sched.evaluated_tokens, "Prompt tokens evaluated by the slots.")
        m = state.metrics  # the worker's copies, made with worker_step_seconds (a reading between steps agrees)
        gauges["worker_eval_seconds"] = (m.worker_eval_seconds,
                                         "Wall time of the steps inside the engine's eval_batch.")
        gauges["worker_decode_steps"] = (m.worker_decode_steps, "Steps of sampled tokens alone (no prompt rows).")
        gauges["worker_decode_eval_seconds"] = (m.worker_decode_seconds, "Their wall time inside eval_batch.")
    kv = getattr(sched, "kv", None)
    if kv is not None:  # the paged cache (server/paged_scheduler.py): its blocks and the radix prefix cache
        r = sched.radix
        gauges.update({
            "kv_blocks_total": (kv.pool.n_blocks, f"KV cache blocks of {kv.block_size} tokens."),
            "kv_blocks_free": (kv.pool.n_free, "Blocks held by no sequence and not by the prefix cache."),
            "prefix_cache_blocks": (r.n_blocks, "Blocks the prefix cache holds (idle: free + these = total)."),
            "prefix_cache_queries": (r.stats.queries, "Prefix cache lookups."),
            "prefix_cache_hits": (r.stats.hits, "Lookups that matched at least one block."),
            "prefix_cache_hit_tokens": (r.stats.hit_tokens, "Prompt tokens found in the prefix cache."),
            "prefix_cache_evicted_blocks": (r.stats.evicted_blocks, "Blocks evicted from the prefix cache."),
            "preemptions": (sched.preemptions, "Sequences stopped for blocks, recomputed later."),
        })
    return PlainTextResponse(M.render(state.metrics, gauges), media_type="text/plain; version=0.0.4")


def page_html() -> str:
    return resources.files("hybrid.server").joinpath("static/index.html").read_text(encoding="utf-8")


async def page(request: Request):
    return HTMLResponse(request.app.state.page)
