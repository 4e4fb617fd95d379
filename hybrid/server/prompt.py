"""From a request to prompt tokens: chat messages (and tools) rendered by the chat template, or a completion's
text or token ids; checked against the context before the request queues."""

from __future__ import annotations

import datetime
import json

from hybrid.errors import HybridError
from hybrid.server.reasoning import prompt_opens_think
from hybrid.server.schemas import BadRequest, GenRequest
from hybrid.server.toolcalls import tools_system_prompt


def _strftime_now(fmt: str) -> str:  # Llama 3.x templates date their system prompt with it
    return datetime.datetime.now().strftime(fmt)


def _without_tool_support(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template that knows nothing of tools: the tools described in the system message, earlier
    calls written out in the Hermes form."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c.get("function", {}).get("name"),
                                                            "arguments": c.get("function", {}).get("arguments")},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            m = {"role": m["role"], "content": ((m.get("content") or "") + "\n" + calls).strip()}
        out.append(m)
    if tools:
        desc = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + desc)
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out


def _prefill(messages: list[dict]) -> tuple[list[dict], str]:
    """A conversation that ends with an assistant message asks to continue it (llama-server's prefill): the
    messages before it, and its text to append after the generation prompt."""
    if not messages or messages[-1]["role"] != "assistant":
        return messages, ""
    if len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise BadRequest("cannot have 2 or more assistant messages at the end of the list: the last one is "
                         "continued (prefill), so the one before it must not be an assistant message", "messages")
    if messages[-1].get("tool_calls"):
        raise BadRequest("cannot continue an assistant message that holds tool calls; end with the tool's result",
                         "messages")
    return messages[:-1], messages[-1].get("content") or ""


def render_chat(state, req: GenRequest) -> str:
    """The conversation (and tools) through the chat template, as prompt text."""
    tok, tpl = state.engine.tokenizer, state.template
    messages, prefill = _prefill(req.messages)
    extra = {"strftime_now": _strftime_now}
    if "tools" in tpl.source:
        if req.tools:
            extra["tools"] = req.tools
    else:
        messages = _without_tool_support(messages, req.tools)
    bos = tok.piece(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.piece(tok.eos_id) if tok.eos_id is not None else ""
    try:
        text = tpl.render(messages, add_generation_prompt=True, bos_token=bos, eos_token=eos, **extra)
    except HybridError as exc:
        raise BadRequest(str(exc), "messages") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise BadRequest(f"chat template '{tpl.name}' failed to render these messages: "
                         f"{type(exc).__name__}: {exc}", "messages") from None
    return text + prefill


def chat_prompt(state, req: GenRequest) -> tuple[list[int], bool]:
    """The token ids of the rendered conversation, and whether it ends inside an open <think>."""
    text = render_chat(state, req)
    return state.engine.tokenizer.encode(text, add_special=True, parse_special=True), prompt_opens_think(text)


def completion_prompt(state, req: GenRequest) -> list[int]:
    """A completion's text, its token ids, or a sequence mixing both (llama-server's form: the strings are
    tokenized in place, special tokens added only when a string comes first)."""
    tok = state.engine.tokenizer
    if isinstance(req.prompt, str):
        return tok.encode(req.prompt, add_special=True, parse_special=True)
    ids: list[int] = []
    for k, part in enumerate(req.prompt):
        if isinstance(part, str):
            ids += tok.encode(part, add_special=k == 0, parse_special=True)
        elif not 0 <= part < tok.n_vocab:
            raise BadRequest(f"'prompt' token id {part} is outside the vocabulary [0, {tok.n_vocab})", "prompt")
        else:
            ids.append(part)
    return ids


def check_context(state, n_prompt: int, param: str) -> None:
    """400 with the numbers when the prompt leaves no room in the context."""
    n_ctx = state.n_ctx
    if n_prompt >= n_ctx:
        raise BadRequest(f"the prompt is {n_prompt} tokens and the context {n_ctx} (-c), which leaves no room to "
                         "generate; shorten the input or restart the server with a larger -c", param,
                         kind="exceed_context_size_error", extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})
    if n_prompt == 0:
        raise BadRequest("the prompt is empty after tokenization")
