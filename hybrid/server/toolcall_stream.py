"""Tool calls while a reply streams, as llama-server streams them: text that may be a call is held back from the
content; a call's first delta carries its index, id, type and name (once the name is complete and one of the
request's tools), the next ones only the index and the pieces of `function.arguments` as they are generated. At the
end the whole reply is parsed (toolcalls.parse_tool_calls); what the stream has not said yet goes out then."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybrid.text.stream import partial_tail
from hybrid.server.partial_json import Malformed, object_fields, skip_ws
from hybrid.server.toolcalls import HERMES_OPEN, PYTHON_TAG, new_call_id, parse_tool_calls

Fields = dict[str, tuple[int, int | None]]


def scan_calls(text: str) -> list[tuple[Fields, int | None]]:
    """The call objects of a captured reply so far, in order: (their fields, their end or None while open).
    The Hermes form (`<tool_call>{…}</tool_call>` …) or the Llama 3 form (`{…}`, `{…}; {…}` or `[{…}, {…}]`,
    optionally after <|python_tag|>). Stops at the first thing that is neither."""
    out: list[tuple[Fields, int | None]] = []
    try:
        if text.lstrip().startswith(HERMES_OPEN):
            i = 0
            while (j := text.find(HERMES_OPEN, i)) >= 0:
                k = skip_ws(text, j + len(HERMES_OPEN))
                if k >= len(text) or text[k] != "{":
                    break
                fields, end = object_fields(text, k)
                out.append((fields, end))
                if end is None:
                    break
                i = end
            return out
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        sep = ";"
        if i < len(text) and text[i] == "[":
            i, sep = skip_ws(text, i + 1), ","
        while i < len(text) and text[i] == "{":
            fields, end = object_fields(text, i)
            out.append((fields, end))
            if end is None:
                break
            i = skip_ws(text, end)
            if i >= len(text) or text[i] != sep:
                break
            i = skip_ws(text, i + 1)
    except Malformed:
        pass
    return out


@dataclass
class _Sent:
    id: str
    name: str
    args: str = ""  # the raw text of the arguments sent so far


class CallStreamer:
    """update(captured text) -> the tool_calls delta entries it adds; finish(parsed calls) -> the calls with the
    streamed ids, and the entries still to send."""

    def __init__(self, names: set[str]):
        self.names = names
        self.sent: list[_Sent] = []

    def update(self, text: str) -> list[dict]:
        entries: list[dict] = []
        for k, (fields, _) in enumerate(scan_calls(text)):
            if k == len(self.sent):
                name = _string(text, fields.get("name"))
                if name is None or (self.names and name not in self.names):
                    break
                self.sent.append(_Sent(new_call_id(), name))
                entries.append({"index": k, "id": self.sent[k].id, "type": "function",
                                "function": {"name": name, "arguments": ""}})
            piece = self._args_piece(text, fields, self.sent[k])
            if not piece:
                continue
            if entries and entries[-1]["index"] == k:
                entries[-1]["function"]["arguments"] += piece
            else:
                entries.append({"index": k, "function": {"arguments": piece}})
        return entries

    @staticmethod
    def _args_piece(text: str, fields: Fields, sent: _Sent) -> str:
        """The raw text of an object (or array) of arguments added since last time; a string of arguments (JSON
        encoded in JSON) waits for the end."""
        key = "arguments" if "arguments" in fields else "parameters" if "parameters" in fields else None
        if key is None:
            return ""
        start, end = fields[key]
        if text[start] not in "{[":
            return ""
        raw = text[start:end if end is not None else len(text)]
        if not raw.startswith(sent.args):
            return ""
        piece, sent.args = raw[len(sent.args):], raw
        return piece

    def finish(self, calls: list[dict]) -> tuple[list[dict], list[dict]]:
        tail = []
        for k, call in enumerate(calls):
            fn = call["function"]
            if k >= len(self.sent):
                tail.append({"index": k, "id": call["id"], "type": "function", "function": dict(fn)})
                continue
            s = self.sent[k]
            call["id"] = s.id
            if fn["arguments"].startswith(s.args):
                rest = fn["arguments"][len(s.args):]
            else:  # the same JSON spaced differently, or (cannot be taken back) text that changed
                rest = ""
            if rest:
                tail.append({"index": k, "function": {"arguments": rest}})
        return calls, tail


def _string(text: str, span: tuple[int, int | None] | None) -> str | None:
    if span is None or span[1] is None or text[span[0]] != '"':
        return None
    return json.loads(text[span[0]:span[1]])


class ToolCallCatcher:
    """push(text) -> the content safe to emit now; deltas() -> the tool_calls delta entries streamed since last
    asked; finish() -> (content held back that was no call, the calls), its last entries then in deltas()."""

    def __init__(self, enabled: bool, names: set[str] | frozenset[str] = frozenset()):
        self.enabled = enabled
        self.pending = ""
        self.captured: str | None = None  # from the first sign of a call to the end of the reply
        self.seen_text = False  # non-blank content went out already (the JSON form only counts at the start)
        self.streamer = CallStreamer(set(names))
        self._entries: list[dict] = []

    def push(self, text: str) -> str:
        if not self.enabled:
            return text
        if self.captured is not None:
            self.captured += text
            self._entries += self.streamer.update(self.captured)
            return ""
        self.pending += text
        body = self.pending.lstrip()
        if not self.seen_text:
            if not body:
                return ""
            if body.startswith("{") or body.startswith(PYTHON_TAG) or body.startswith(HERMES_OPEN):
                self.captured, self.pending = body, ""
                self._entries += self.streamer.update(self.captured)
                return ""
            if PYTHON_TAG.startswith(body) or HERMES_OPEN.startswith(body):
                return ""
        i = self.pending.find(HERMES_OPEN)
        if i >= 0:
            out, self.captured, self.pending = self.pending[:i], self.pending[i:], ""
            self.seen_text = self.seen_text or bool(out.strip())
            self._entries += self.streamer.update(self.captured)
            return out
        cut = len(self.pending) - partial_tail(self.pending, (HERMES_OPEN,))
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.seen_text = self.seen_text or bool(out.strip())
        return out

    def deltas(self) -> list[dict]:
        out, self._entries = self._entries, []
        return out

    def finish(self) -> tuple[str, list[dict]]:
        if self.captured is None:
            rest, self.pending = self.pending, ""
            return rest, []
        text = self.captured
        calls = parse_tool_calls(text)
        if not calls:  # not a call after all (if its start was streamed already, the text follows as content)
            return self.pending + text, []
        calls, tail = self.streamer.finish(calls)
        self._entries += tail
        return "", calls
