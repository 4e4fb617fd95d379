"""Tool calls in a reply: the Hermes/Qwen form `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (one or
more) and the Llama 3 JSON form `{"name": …, "parameters": {…}}` (optionally after <|python_tag|>): parsing a whole
reply into OpenAI `tool_calls`, and the system prompt that tells a template without tool support about them.
toolcall_stream.py catches and streams them while the reply is generated."""

from __future__ import annotations

import json
import re
import secrets

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(text: str) -> list[dict]:
    """OpenAI `tool_calls` entries parsed from a reply's text ([] when it holds no well-formed call)."""
    text = text.strip()
    raw: list = []
    if text.startswith(HERMES_OPEN):
        blocks = _HERMES_BLOCK.findall(text)
        outside = _HERMES_BLOCK.sub("", text).strip()
        if outside:
            return []
        for b in blocks:
            obj = _loads(b)
            if obj is None:
                return []
            raw.append(obj)
    else:
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].strip()
        obj = _loads(text)
        if obj is None:  # Llama 3.x sometimes separates several calls with ";"
            parts = [_loads(p) for p in text.split(";") if p.strip()]
            if not parts or any(p is None for p in parts):
                return []
            obj = parts
        raw = obj if isinstance(obj, list) else [obj]
    calls = []
    for obj in raw:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append({"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}})
    return calls


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def tools_system_prompt(tools: list[dict]) -> str:
    """The instructions a template without tool support gets (Hermes form, as Qwen 2.5's own template says it)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
