"""gpt-oss's chat format, harmony: the built-in template (for files without their own) and the splitter that turns
a reply's channels into reasoning (`analysis`) and content (`final`, `commentary`).

A harmony reply is a sequence of messages, each `<|channel|>NAME<|message|>TEXT` closed by `<|end|>` (more to
come, the next one opening with `<|start|>assistant`), `<|return|>` or `<|call|>` (the last two end the generation).
The splitter reads the reply's text with its special tokens written out (TextStream(special=True)).
"""

from __future__ import annotations

from hybrid.text.stream import partial_tail

HARMONY_TEMPLATE = (
    "{%- set sys = namespace(text='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' or m.role == 'developer' -%}"
    "{%- set sys.text = sys.text + m.content -%}{%- endif -%}{%- endfor -%}"
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' -}}"
    "{%- if sys.text -%}{{- '<|start|>developer<|message|># Instructions\n\n' + sys.text + '<|end|>' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS, "<|constrain|>")
REASONING_CHANNELS = ("analysis",)


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss's built-in or the GGUF's own)."""
    return CHANNEL in template_source and MESSAGE in template_source


class HarmonySplitter:
    """push(text) -> [(kind, text)], kind "reasoning" or "content", as server.reasoning.ReasoningSplitter: the
    analysis channel is reasoning, the others content; the markers and headers are dropped. Text before any
    channel header counts as content (a model that ignores the format)."""

    def __init__(self) -> None:
        self.state = "body"  # body | header (after <|start|> or an end) | channel (between <|channel|> and <|message|>)
        self.kind = "content"
        self.name = ""
        self.pending = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while self.pending:
            i = self.pending.find("<|")
            if i < 0:
                keep = 1 if self.pending.endswith("<") else 0  # maybe a marker's first character
                self._take(self.pending[: len(self.pending) - keep], out)
                self.pending = self.pending[len(self.pending) - keep :]
                break
            if i:
                self._take(self.pending[:i], out)
                self.pending = self.pending[i:]
            j = self.pending.find("|>", 2)
            if j < 0:
                if partial_tail(self.pending, MARKERS) == len(self.pending):
                    break  # maybe a marker, not yet complete
                self._take(self.pending[:2], out)
                self.pending = self.pending[2:]
                continue
            marker = self.pending[: j + 2]
            self.pending = self.pending[j + 2 :]
            self._marker(marker, out)
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        rest, self.pending = self.pending, ""
        self._take(rest, out)
        return out

    def _take(self, text: str, out: list) -> None:
        if self.state == "channel":
            self.name += text
        elif self.state == "body" and text:
            if out and out[-1][0] == self.kind:
                out[-1] = (self.kind, out[-1][1] + text)
            else:
                out.append((self.kind, text))

    def _marker(self, marker: str, out: list) -> None:
        if marker == CHANNEL:
            self.state, self.name = "channel", ""
        elif marker == MESSAGE:
            name = self.name.strip().split(" ", 1)[0]  # "commentary to=functions.f" names the channel first
            self.kind = "reasoning" if name in REASONING_CHANNELS else "content"
            self.state = "body"
        elif marker == START or marker in ENDS:
            self.state = "header"
        elif marker != "<|constrain|>":
            self._take(marker, out)  # not a harmony marker: text
