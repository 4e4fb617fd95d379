"""The interactive loop of `hybrid run -cnv` / `hybrid chat`: read a line, stream the reply."""

from __future__ import annotations

import sys

from hybrid.text.chat_template import choose_template
from hybrid.generate.chat import ChatSession
from hybrid.engine.engine import Engine
from hybrid.generate.timings import Timings
from hybrid.generate.sampling import SamplingParams
from hybrid.text.stream import TextStream

from hybrid.cli.session import note


def chat_loop(engine: Engine, sampling: SamplingParams, n_predict: int, template_name: str | None,
              system: str | None, first: str | None) -> None:
    template = choose_template(engine.gguf.metadata, engine.config.arch, template_name)
    session = ChatSession(engine, sampling, template, system)
    note(f"chat template: {template.name}. Type a message; an empty line or Ctrl-D ends the chat.")
    pending = first
    while True:
        if pending is None:
            try:
                sys.stdout.write("\n> ")
                sys.stdout.flush()
                pending = sys.stdin.readline()
            except KeyboardInterrupt:
                return
            if not pending or not pending.strip():
                return
            pending = pending.rstrip("\n")
        else:
            sys.stdout.write(f"> {pending}\n")
        stream = TextStream(engine.tokenizer)
        timings = Timings()
        for t in session.send(pending, n_predict, timings):
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()
        sys.stdout.write(stream.flush() + "\n")
        note(f"[{timings.prompt_tokens} new prompt tokens ({session.last_reused} reused from the cache), "
             f"{timings.rate(timings.prompt_tokens, timings.prompt_ms):.1f} t/s prompt, "
             f"{timings.rate(timings.eval_tokens, timings.eval_ms):.1f} t/s generation]")
        pending = None
