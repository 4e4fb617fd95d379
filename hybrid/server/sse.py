"""Server-sent events for stream: true, as OpenAI frames them: `data: {json}` per chunk, every chunk with the same
id and created; the first delta carries the role, the last chunk the finish_reason, then the usage chunk when
stream_options.include_usage asks, then `data: [DONE]`. A client that goes away cancels its job."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from hybrid.server import responses as R
from hybrid.server.slot import Delta, Failure, Final, Job

DONE = "data: [DONE]\n\n"


def frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def job_events(state, job: Job) -> AsyncIterator:
    """Queue the job and yield its events up to its Final or Failure; leaving early (the client went away, or
    the server stops) cancels it: skipped if still queued, stopped within one token if running."""
    state.slots.submit(job)
    try:
        while True:
            ev = await job.next_event()
            yield ev
            if isinstance(ev, (Final, Failure)):
                return
    finally:
        job.cancel.set()
        state.slots.forget(job)


async def chat_stream(state, job: Job, rid: str, created: int, model: str) -> AsyncIterator[str]:
    req = job.req
    usage_flag = req.include_usage

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> str:
        return frame(R.chat_chunk(rid, created, model, delta, finish,
                                  logprobs if req.logprobs else None, usage_flag))

    yield chunk({"role": "assistant", "content": ""})
    async for ev in job_events(state, job):
        if isinstance(ev, Delta):
            delta = {}
            if ev.reasoning:
                delta["reasoning_content"] = ev.reasoning
            if ev.content or not (ev.reasoning or ev.tool_calls):
                delta["content"] = ev.content
            if delta or ev.logprobs:
                yield chunk(delta, None, ev.logprobs)
            for entry in ev.tool_calls:  # one call's piece a chunk, as llama-server sends them
                yield chunk({"tool_calls": [entry]})
        elif isinstance(ev, Final):
            last = R.chat_chunk(rid, created, model, {}, ev.finish_reason, None, usage_flag)
            last["timings"] = ev.timings
            yield frame(last)
            if usage_flag:
                yield frame({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "system_fingerprint": "hybrid", "choices": [], "usage": ev.usage,
                             "timings": ev.timings})
            yield DONE
        else:
            yield frame(R.error_body(ev.message, "server_error", code=500))
            yield DONE


async def completion_stream(state, job: Job, rid: str, created: int, model: str) -> AsyncIterator[str]:
    req = job.req
    offset = 0
    async for ev in job_events(state, job):
        if isinstance(ev, Delta):
            lp = R.completion_logprobs(ev.logprobs, offset) if req.logprobs else None
            offset += len(ev.content)
            yield frame(R.text_completion(rid, created, model, ev.content, None, lp))
        elif isinstance(ev, Final):
            yield frame(R.text_completion(rid, created, model, "", ev.finish_reason, None, timings=ev.timings))
            if req.include_usage:
                out = R.text_completion(rid, created, model, "", None, None, usage=ev.usage, timings=ev.timings)
                out["choices"] = []
                yield frame(out)
            yield DONE
        else:
            yield frame(R.error_body(ev.message, "server_error", code=500))
            yield DONE
