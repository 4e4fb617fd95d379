"""Reasoning: a reply that opens with <think>…</think> has that part returned as `reasoning_content`
(`--reasoning-format deepseek`, llama-server's behaviour); `none` leaves it in the content."""

from __future__ import annotations

from hybrid.text.stream import partial_tail

OPEN, CLOSE = "<think>", "</think>"
REASONING_FORMATS = ("none", "deepseek", "auto")  # auto: as deepseek (llama-server's default)


class ReasoningSplitter:
    """push(text) -> [(kind, text)] with kind "reasoning" or "content". Reasoning is only recognised at the start
    of the reply (or from the start when the prompt already opened <think>), as llama-server's deepseek parser."""

    def __init__(self, enabled: bool, started: bool = False):
        self.enabled = enabled
        self.state = "think" if (enabled and started) else ("start" if enabled else "content")
        self.pending = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        if self.state == "content":
            return [("content", text)] if text else []
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                body = self.pending.lstrip()
                if body.startswith(OPEN):
                    self.pending, self.state = body[len(OPEN):], "think"
                    continue
                if not body or OPEN.startswith(body):
                    return out  # maybe the opening tag, not yet complete
                self.state = "content"
                out.append(("content", self.pending))
                self.pending = ""
                return out
            if self.state == "think":
                i = self.pending.find(CLOSE)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.pending[:i]))
                    self.pending, self.state = self.pending[i + len(CLOSE):].lstrip(), "after"
                    continue
                keep = partial_tail(self.pending, (CLOSE,))
                cut = len(self.pending) - keep
                if cut:
                    out.append(("reasoning", self.pending[:cut]))
                self.pending = self.pending[cut:]
                return out
            # "after": the content that follows </think>, its leading blank lines dropped
            body = self.pending.lstrip()
            if body:
                self.state = "content"
                out.append(("content", body))
            self.pending = ""
            return out

    def flush(self) -> list[tuple[str, str]]:
        rest, self.pending = self.pending, ""
        if not rest:
            return []
        if self.state == "think":
            return [("reasoning", rest)]  # the reply ended inside the reasoning
        return [("content", rest)] if self.state != "after" or rest.strip() else []


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open <think> (templates that start the reply thinking)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)
