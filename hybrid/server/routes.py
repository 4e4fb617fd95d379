"""The OpenAI routes: POST /v1/chat/completions and /v1/completions, streaming (SSE) or not."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from hybrid.server import responses as R
from hybrid.server.prompt import chat_prompt, check_context, completion_prompt
from hybrid.server.schemas import BadRequest, parse_chat, parse_completion
from hybrid.server.slot import Failure, Final, Job
from hybrid.server.sse import chat_stream, completion_stream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes, 400 for anything that is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body is {int(declared)} bytes, more than the limit of {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is more than the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise BadRequest("the request body is empty: send a JSON object")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") \
            from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(state, job: Job, request: Request):
    """A non-streaming answer: (deltas gathered, the Final); None when the client left first (the job is then
    cancelled); Failure when generation failed."""
    got = R.Collected()
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    state.slots.submit(job)
    try:
        while True:
            nxt = asyncio.ensure_future(job.next_event())
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                return None
            ev = nxt.result()
            if isinstance(ev, Failure):
                return ev
            if isinstance(ev, Final):
                return got, ev
            got.add(ev)
    finally:
        job.cancel.set()
        state.slots.forget(job)
        watcher.cancel()


async def chat_completions(request: Request):
    state = request.app.state.server
    req = parse_chat(await read_json(request, state.config.max_body))
    ids, opens_think = await run_in_threadpool(chat_prompt, state, req)
    check_context(state, len(ids), "messages")
    job = Job(req, ids, asyncio.get_running_loop(), opens_think)
    rid, created, model = R.new_id("chatcmpl"), int(time.time()), state.config.alias
    if req.stream:
        return StreamingResponse(chat_stream(state, job, rid, created, model), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    result = await collect(state, job, request)
    if result is None or isinstance(result, Failure):
        return _failed(result)
    got, final = result
    return JSONResponse(R.chat_completion(rid, created, model, got, final, req.logprobs))


async def completions(request: Request):
    state = request.app.state.server
    req = parse_completion(await read_json(request, state.config.max_body))
    ids = await run_in_threadpool(completion_prompt, state, req)
    check_context(state, len(ids), "prompt")
    job = Job(req, ids, asyncio.get_running_loop())
    rid, created, model = R.new_id("cmpl"), int(time.time()), state.config.alias
    if req.stream:
        return StreamingResponse(completion_stream(state, job, rid, created, model), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    result = await collect(state, job, request)
    if result is None or isinstance(result, Failure):
        return _failed(result)
    got, final = result
    lp = R.completion_logprobs(got.logprobs) if req.logprobs else None
    return JSONResponse(R.text_completion(rid, created, model, "".join(got.content), final.finish_reason, lp,
                                          final.usage, final.timings))


def _failed(result: Failure | None) -> JSONResponse:
    if result is None:  # nobody is listening; 499 as nginx logs a client that closed the request
        return JSONResponse(R.error_body("client closed the request", "cancelled", code=499), status_code=499)
    return JSONResponse(R.error_body(result.message, "server_error", code=500), status_code=500)
