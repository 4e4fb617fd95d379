"""Chat templates: the built-in gemma template equals llama.cpp's (the greedy fixture's chat prompt)."""

from __future__ import annotations

import json

import pytest

from hybrid.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, choose_template
from hybrid.errors import HybridError


def test_gemma_template_matches_llama_cpp_builtin(fixtures_dir):
    cases = json.loads((fixtures_dir / "gemma-3-270m" / "greedy.json").read_text())["cases"]
    chat = next(c for c in cases if c["kind"].startswith("chat"))
    rendered = ChatTemplate("gemma", BUILTIN_TEMPLATES["gemma"]).render([{"role": "user", "content": "What is 2+2?"}])
    assert rendered == chat["prompt"]


def test_gguf_template_wins_and_override():
    md = {"tokenizer.chat_template": "{{ messages[0].content }}!"}
    assert choose_template(md, "llama").render([{"role": "user", "content": "hi"}]) == "hi!"
    assert choose_template({}, "gemma3").name == "gemma"
    assert choose_template({}, "qwen2").name == "chatml"
    assert choose_template(md, "llama", "chatml").name == "chatml"
    with pytest.raises(HybridError, match="neither a built-in"):
        choose_template({}, "llama", "no-such-template")


def test_multi_turn_gemma():
    t = ChatTemplate("gemma", BUILTIN_TEMPLATES["gemma"])
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
