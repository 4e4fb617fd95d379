"""Request bodies of /v1/chat/completions and /v1/completions checked by hand into one GenRequest: wrong types and
out-of-range values are BadRequest (400) naming the field, what was expected and what was found; unknown fields
are ignored, as OpenAI's API does."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybrid.generate.sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGPROBS = 20


class BadRequest(Exception):
    """A client error: the HTTP status, a one-line message and the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 extra: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.extra = extra or {}  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)


@dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = -1  # -1: until an end-of-generation token or the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    cache_prompt: bool = True
    messages: list[dict] = field(default_factory=list)  # chat
    tools: list[dict] = field(default_factory=list)
    tool_choice: object = "auto"
    prompt: str | list[int | str] = ""  # completion: text, token ids, or both mixed


def _type_name(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _num(body: dict, name: str, default, *, integer: bool = False, low=None, high=None, low_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {_type_name(v)}", name)
    if not integer and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be finite, got {v}", name)
    if low is not None and (v <= low if low_open else v < low):
        raise BadRequest(f"'{name}' must be {'above' if low_open else 'at least'} {low}, got {v}", name)
    if high is not None and v > high:
        raise BadRequest(f"'{name}' must be at most {high}, got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {_type_name(v)}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise BadRequest(f"'stop' must be a string or an array of strings, got {_type_name(v)}", "stop")


def _common(body: dict, kind: str) -> GenRequest:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_type_name(body)}")
    n = _num(body, "n", 1, integer=True)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one generation slot; ask {n} times instead), got {n}", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", body.get("n_predict")))
    name = next((k for k in ("max_completion_tokens", "max_tokens", "n_predict") if body.get(k) is not None), "max_tokens")
    max_tokens = _num({name: max_tokens}, name, -1, integer=True, low=-1 if name == "n_predict" else 1)
    if max_tokens == 0:
        raise BadRequest(f"'{name}' must be at least 1, got 0", name)
    defaults = SamplingParams()
    sampling = SamplingParams(
        temp=_num(body, "temperature", defaults.temp, low=0.0),
        top_p=_num(body, "top_p", defaults.top_p, low=0.0, high=1.0, low_open=True),
        top_k=_num(body, "top_k", defaults.top_k, integer=True, low=0),
        min_p=_num(body, "min_p", defaults.min_p, low=0.0, high=1.0),
        repeat_penalty=_num(body, "repeat_penalty", defaults.repeat_penalty, low=0.0, low_open=True),
        repeat_last_n=_num(body, "repeat_last_n", defaults.repeat_last_n, integer=True, low=-1),
        presence_penalty=_num(body, "presence_penalty", defaults.presence_penalty, low=-2.0, high=2.0),
        frequency_penalty=_num(body, "frequency_penalty", defaults.frequency_penalty, low=-2.0, high=2.0),
        seed=_num(body, "seed", -1, integer=True),
    )
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest(f"'stream_options' must be an object, got {_type_name(opts)}", "stream_options")
    include_usage = _bool(opts or {}, "include_usage", False)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise BadRequest(f"'response_format' {fmt.get('type')!r} is not supported (only 'text')", "response_format")
    return GenRequest(kind, stream=stream, include_usage=include_usage, max_tokens=max_tokens, sampling=sampling,
                      stop=_stop(body), cache_prompt=_bool(body, "cache_prompt", True))


def _content(msg: dict, i: int) -> str | None:
    c = msg.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                what = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise BadRequest(f"messages[{i}].content: only text parts are supported, got {what!r}",
                                 f"messages[{i}].content")
            parts.append(part["text"])
        return "\n".join(parts)  # as llama-server (and vLLM) join text parts
    raise BadRequest(f"messages[{i}].content must be a string or an array of text parts, got {_type_name(c)}",
                     f"messages[{i}].content")


def parse_chat(body) -> GenRequest:
    req = _common(body, "chat")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise BadRequest(f"'messages' must be an array of messages, got {_type_name(msgs)}", "messages")
    if not msgs:
        raise BadRequest("'messages' is empty: give at least one message", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object, got {_type_name(m)}", f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                             f"messages[{i}].role")
        msg = dict(m, content=_content(m, i))
        if msg["content"] is None and not m.get("tool_calls"):
            msg["content"] = ""
        req.messages.append(msg)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  and isinstance(t["function"].get("name"), str) for t in tools):
            raise BadRequest("'tools' must be an array of {\"type\": \"function\", \"function\": {\"name\": …}}",
                             "tools")
        req.tools = tools
    req.tool_choice = body.get("tool_choice", "auto")
    if req.tool_choice == "none":
        req.tools = []
    req.logprobs = _bool(body, "logprobs", False)
    req.top_logprobs = _num(body, "top_logprobs", 0, integer=True, low=0, high=MAX_LOGPROBS)
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return req


def parse_completion(body) -> GenRequest:
    req = _common(body, "completion")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise BadRequest("'prompt' is empty", "prompt")
    elif isinstance(p, list) and p and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in p) \
            and any(isinstance(t, int) for t in p):
        pass  # token ids, or (llama-server) token ids and strings mixed in one prompt
    elif isinstance(p, list) and len(p) > 1:
        raise BadRequest(f"'prompt' holds {len(p)} prompts; one per request (one generation slot)", "prompt")
    else:
        raise BadRequest(f"'prompt' must be a non-empty string or array of token ids, got {_type_name(p)}", "prompt")
    req.prompt = p
    if _bool(body, "echo", False):
        raise BadRequest("'echo' is not supported", "echo")
    lp = _num(body, "logprobs", None, integer=True, low=0, high=MAX_LOGPROBS)
    req.logprobs, req.top_logprobs = lp is not None, lp or 0
    return req
