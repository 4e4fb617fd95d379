"""Chat templates: the GGUF's own `tokenizer.chat_template` (jinja2), or a built-in one chosen by name/architecture.

`--chat-template NAME|FILE`: a built-in name (gemma, chatml, llama3, llama2, harmony), or a path to a jinja2 file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.sandbox

from hybrid.errors import HybridError
from hybrid.text.harmony import HARMONY_TEMPLATE

BUILTIN_TEMPLATES: dict[str, str] = {
    # llama.cpp's built-in `gemma` template; Gemma has no system role: a system message is prefixed to the first user turn.
    "gemma": (
        "{%- set sys = namespace(text='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{%- set sys.text = sys.text + m.content + '\n\n' -%}"
        "{%- else -%}"
        "{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' + sys.text + m.content | trim + '<end_of_turn>\n' -}}"
        "{%- set sys.text = '' -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
    ),
    "chatml": (
        "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    ),
    "llama3": (
        "{%- for m in messages -%}"
        "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
    ),
    "llama2": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{{- '[INST] <<SYS>>\n' + m.content + '\n<</SYS>>\n\n' -}}"
        "{%- elif m.role == 'user' -%}{{- ('' if loop.index0 > 0 and messages[loop.index0 - 1].role == 'system' else '[INST] ') + m.content | trim + ' [/INST]' -}}"
        "{%- else -%}{{- ' ' + m.content | trim + ' </s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    ),
    "harmony": HARMONY_TEMPLATE,  # gpt-oss (text/harmony.py)
}
DEFAULT_FOR_ARCH = {"gemma3": "gemma", "qwen2": "chatml", "qwen3": "chatml", "qwen3moe": "chatml", "llama": "llama3",
                    "gpt-oss": "harmony"}


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    source: str

    def render(self, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
               eos_token: str = "", **extra) -> str:
        """The prompt text; `extra` are further template variables (`tools=[…]` for templates that take them)."""
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            tpl = env.from_string(self.source)
            return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=bos_token, eos_token=eos_token, **extra)
        except jinja2.TemplateError as exc:
            raise HybridError(f"chat template '{self.name}' failed to render: {exc}") from None


def _raise(msg: str):
    raise jinja2.TemplateError(msg)


def choose_template(metadata: dict, arch: str, override: str | None = None) -> ChatTemplate:
    """The override (built-in name or jinja2 file), else the GGUF's template, else the architecture's built-in."""
    if override:
        if override in BUILTIN_TEMPLATES:
            return ChatTemplate(override, BUILTIN_TEMPLATES[override])
        path = Path(override).expanduser()
        if path.is_file():
            return ChatTemplate(str(path), path.read_text(encoding="utf-8"))
        raise HybridError(
            f"--chat-template '{override}' is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor a file"
        )
    src = metadata.get("tokenizer.chat_template")
    if isinstance(src, str) and src.strip():
        return ChatTemplate("gguf", src)
    name = DEFAULT_FOR_ARCH.get(arch, "chatml")
    return ChatTemplate(name, BUILTIN_TEMPLATES[name])
