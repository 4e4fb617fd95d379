"""The interactive loop of `hybrid run -cnv` / `hybrid chat`: read a line, stream the reply.

As llama-cli: Ctrl-C during a reply stops it and returns to the prompt; Ctrl-C at the prompt (so a second one),
Ctrl-D or an empty line ends the chat. A turn that does not fit the context is refused in one line and the chat
goes on."""

from __future__ import annotations

import sys

import typer

from hybrid.text.chat_template import choose_template
from hybrid.errors import ContextTooLarge, HybridError
from hybrid.generate.chat import ChatSession
from hybrid.engine.engine import Engine
from hybrid.generate.timings import Timings
from hybrid.generate.sampling import SamplingParams
from hybrid.text.harmony import HarmonySplitter
from hybrid.text.stream import TextStream

from hybrid.cli.errors import one_line
from hybrid.cli.session import clean_text, note

EXIT_INTERRUPTED = 130


def chat_loop(engine: Engine, sampling: SamplingParams, n_predict: int, template_name: str | None,
              system: str | None, first: str | None, special: bool = False, speculator=None) -> None:
    try:
        template = choose_template(engine.gguf.metadata, engine.config.arch, template_name)
    except UnicodeDecodeError as exc:  # a --chat-template file that is not UTF-8
        raise HybridError(f"--chat-template {template_name}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at "
                          f"offset {exc.start})") from None
    session = ChatSession(engine, sampling, template, system, speculator)
    note(f"chat template: {template.name}. Type a message; Ctrl-C stops a reply; an empty line, Ctrl-D or Ctrl-C "
         "at the prompt ends the chat.")
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # bytes that are not UTF-8 are read as U+FFFD, not an error
    pending = first
    while True:
        if pending is None:
            try:
                sys.stdout.write("\n> ")
                sys.stdout.flush()
                pending = sys.stdin.readline()
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                sys.stdout.flush()
                raise typer.Exit(EXIT_INTERRUPTED) from None
            if not pending or not pending.strip():
                return
            pending = clean_text(pending.rstrip("\n"))
        else:
            sys.stdout.write(f"> {pending}\n")
        stream = HarmonyStream(engine.tokenizer) if session.harmony and not special else TextStream(engine.tokenizer,
                                                                                                         special=special)
        timings = Timings()
        reply = session.send(pending, n_predict, timings)
        pending = None
        stopped = False
        try:
            for t in reply:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()
        except KeyboardInterrupt:  # stop this reply (what it said so far is kept), back to the prompt
            stopped = True
        except ContextTooLarge as exc:
            note(f"{one_line(exc)} (the chat goes on)")
            continue
        finally:
            reply.close()
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        note(f"[{'reply stopped; ' if stopped else ''}{timings.prompt_tokens} new prompt tokens "
             f"({session.last_reused} reused from the cache), "
             f"{timings.rate(timings.prompt_tokens, timings.prompt_ms):.1f} t/s prompt, "
             f"{timings.rate(timings.eval_tokens, timings.eval_ms):.1f} t/s generation"
             + (f"; {session.last_spec.accepted}/{session.last_spec.drafted} drafted tokens accepted"
                if speculator is not None else "") + "]")


class HarmonyStream:
    """TextStream's push/flush for a harmony reply (gpt-oss): only the final channel is shown; the analysis channel
    (its reasoning) and the markers are not."""

    def __init__(self, tokenizer):
        self.text = TextStream(tokenizer, special=True)
        self.split = HarmonySplitter()

    def push(self, token_id: int) -> str:
        return self._content(self.split.push(self.text.push(token_id)))

    def flush(self) -> str:
        return self._content(self.split.push(self.text.flush()) + self.split.flush())

    @staticmethod
    def _content(parts) -> str:
        return "".join(t for k, t in parts if k == "content")
