"""gpt-oss's harmony format: the built-in template, the channel splitter (analysis = reasoning, final = content),
the chat's display and history, and the server's reasoning_content."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from hybrid.cli.chat import HarmonyStream
from hybrid.server.runner import Output
from hybrid.server.slot import Delta
from hybrid.text.chat_template import choose_template
from hybrid.text.harmony import HarmonySplitter, is_harmony

REPLY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")


def _split(text: str, pieces: list[int] | None = None) -> tuple[str, str]:
    s = HarmonySplitter()
    parts = []
    if pieces is None:
        parts += s.push(text)
    else:
        at = 0
        for n in pieces:
            parts += s.push(text[at : at + n])
            at += n
        parts += s.push(text[at:])
    parts += s.flush()
    return "".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content")


def test_template_is_chosen_for_gpt_oss_and_renders_harmony():
    tpl = choose_template({}, "gpt-oss")
    assert tpl.name == "harmony" and is_harmony(tpl.source)
    text = tpl.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Instructions\n\nBe terse.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
                         "<|start|>user<|message|>Bye<|end|><|start|>assistant")
    assert not is_harmony(choose_template({}, "llama").source)


def test_splitter_separates_channels():
    assert _split(REPLY) == ("The user greets; answer briefly.", "Hello! How can I help?")


@pytest.mark.parametrize("seed", range(5))
def test_splitter_is_the_same_in_any_chunks(seed):
    rng = random.Random(seed)
    pieces = [rng.randint(1, 7) for _ in range(len(REPLY))]
    assert _split(REPLY, pieces) == _split(REPLY)


def test_splitter_without_markers_and_with_commentary():
    assert _split("just text, no format") == ("", "just text, no format")
    assert _split("a < b and c|> d <|notamarker|> e") == ("", "a < b and c|> d <|notamarker|> e")
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.f "
            "<|constrain|>json<|message|>{\"a\": 1}<|call|>")
    assert _split(text) == ("think", '{"a": 1}')
    assert _split("<|channel|>analysis<|message|>cut off mid-thou") == ("cut off mid-thou", "")


class FakeTokenizer:
    """Token i is PIECES[i]; markers print only when special text is asked for."""

    PIECES = ["<|channel|>", "analysis", "<|message|>", "Let me think.", "<|end|>", "<|start|>", "assistant",
              "final", "Sure", ", here.", "<|return|>"]

    def decode(self, ids, remove_special=False, unparse_special=False):
        return "".join(p for p in (self.PIECES[i] for i in ids) if unparse_special or not p.startswith("<|"))

    def decode_piece(self, token_id, first, unparse_special=False):  # TextStream's calls: a token's bytes ...
        return self.decode([token_id], unparse_special=unparse_special).encode()

    def clean_text(self, raw):  # ... and the joined bytes as they are (no clean-up of spaces)
        return raw

    def is_eog(self, t):
        return t == 10


IDS = [0, 1, 2, 3, 4, 5, 6, 0, 7, 2, 8, 9, 10]


def test_chat_display_shows_the_final_channel_only():
    s = HarmonyStream(FakeTokenizer())
    shown = "".join(s.push(t) for t in IDS) + s.flush()
    assert shown == "Sure, here."


@pytest.mark.parametrize("reasoning", [True, False])
def test_server_output_puts_analysis_in_reasoning_content(reasoning):
    posted = []
    job = SimpleNamespace(req=SimpleNamespace(kind="chat", stop=[], tools=[]), opens_think=False, post=posted.append)
    out = Output(job, FakeTokenizer(), reasoning, harmony=True)
    for t in IDS:
        out.push(t, None)
    out.finish()
    deltas = [d for d in posted if isinstance(d, Delta)]
    content = "".join(d.content for d in deltas)
    thought = "".join(d.reasoning for d in deltas)
    if reasoning:
        assert (thought, content) == ("Let me think.", "Sure, here.")
    else:
        assert (thought, content) == ("", "Let me think.Sure, here.")
