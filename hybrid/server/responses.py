"""The JSON objects the OpenAI API returns: chat completions and their chunks, text completions, errors."""

from __future__ import annotations

import secrets

from hybrid.server.slot import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Collected:
    """Deltas gathered for a non-streaming answer."""

    def __init__(self):
        self.content, self.reasoning, self.logprobs = [], [], []

    def add(self, d: Delta) -> None:
        self.content.append(d.content)
        self.reasoning.append(d.reasoning)
        self.logprobs += d.logprobs


def chat_message(c: Collected, tool_calls: list[dict]) -> dict:
    content = "".join(c.content)
    msg = {"role": "assistant", "content": content if (content or not tool_calls) else None}
    reasoning = "".join(c.reasoning)
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def chat_completion(rid: str, created: int, model: str, c: Collected, final, want_logprobs: bool) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": "hybrid",
        "choices": [{"index": 0, "message": chat_message(c, final.tool_calls), "finish_reason": final.finish_reason,
                     "logprobs": {"content": c.logprobs} if want_logprobs else None}],
        "usage": final.usage, "timings": final.timings,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: list | None = None, usage: bool = False) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "system_fingerprint": "hybrid",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                        "logprobs": {"content": logprobs} if logprobs is not None else None}]}
    if usage:
        out["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
    return out


def completion_logprobs(entries: list[dict], start: int = 0) -> dict:
    """The legacy completions `logprobs` object."""
    offsets, pos = [], start
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def text_completion(rid: str, created: int, model: str, text: str, finish_reason: str | None, logprobs: dict | None,
                    usage: dict | None = None, timings: dict | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": "hybrid",
           "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}
    if usage is not None:
        out["usage"] = usage
    if timings is not None:
        out["timings"] = timings
    return out
