"""A multi-turn conversation that keeps the KV cache between turns: each turn re-renders the whole
conversation with the chat template, and only the tokens after the longest cached prefix are evaluated."""

from __future__ import annotations

from collections.abc import Iterator

from hybrid.text.chat_template import ChatTemplate, choose_template
from hybrid.text.harmony import HarmonySplitter, is_harmony
from hybrid.engine.engine import Engine
from hybrid.errors import ContextTooLarge
from hybrid.generate.loop import generate
from hybrid.generate.speculative import SpecStats, Speculator
from hybrid.generate.timings import Timings
from hybrid.generate.sampling import SamplingParams


class ChatSession:
    def __init__(self, engine: Engine, sampling: SamplingParams, template: ChatTemplate | None = None,
                 system: str | None = None, speculator: Speculator | None = None):
        self.engine = engine
        self.sampling = sampling
        self.template = template or choose_template(engine.gguf.metadata, engine.config.arch)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cache = engine.new_cache()
        self.cached_ids: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.last_reused = 0  # how many prompt tokens the last turn took from the cache
        self.speculator = speculator  # None: plain decoding
        self.last_spec = SpecStats()  # the last turn's speculative counts

    def send(self, user_text: str, n_predict: int = -1, timings: Timings | None = None) -> Iterator[int]:
        """Add a user turn and stream the reply's token ids; the reply (as far as it got) is recorded when the
        stream ends or is closed. A turn that does not fit the context raises ContextTooLarge before anything is
        evaluated and leaves the conversation as it was, so the chat can go on."""
        tok = self.engine.tokenizer
        messages = [*self.messages, {"role": "user", "content": user_text}]
        text = self.template.render(messages, add_generation_prompt=True,
                                    bos_token=tok.piece(tok.bos_id) if tok.bos_id is not None else "")
        ids = tok.encode(text, add_special=True, parse_special=True)
        if len(ids) > self.cache.n_ctx:
            raise ContextTooLarge(f"this turn makes the conversation {len(ids)} tokens, more than the context of "
                                  f"{self.cache.n_ctx} (-c); raise -c or start a new chat")
        self.messages = messages
        common = 0
        for a, b in zip(ids, self.cached_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token must be evaluated to get logits
        self.cache.n_past = common
        self.last_reused = common
        reply: list[int] = []
        if self.speculator is None:
            tokens = generate(self.engine, ids[common:], self.sampling, n_predict, self.cache, timings)
        else:
            self.last_spec = SpecStats()
            tokens = self.speculator.generate(self.engine, ids[common:], self.sampling, n_predict, self.cache, timings,
                                              prefix=ids[:common], stats=self.last_spec)
        try:
            for t in tokens:
                reply.append(t)
                yield t
        finally:
            self.cached_ids = (ids + reply)[: self.cache.n_past]
            self.messages.append({"role": "assistant", "content": self.reply_text(reply)})

    @property
    def harmony(self) -> bool:
        """Whether replies come in harmony's channels (gpt-oss): their final channel is the answer."""
        return is_harmony(self.template.source)

    def reply_text(self, reply: list[int]) -> str:
        """A reply's text as the conversation keeps it: harmony's final (and commentary) channel, without the
        analysis channel and the markers; otherwise the decoded tokens."""
        if not self.harmony:
            return self.engine.tokenizer.decode(reply)
        split = HarmonySplitter()
        parts = split.push(self.engine.tokenizer.decode(reply, unparse_special=True)) + split.flush()
        return "".join(t for k, t in parts if k == "content")
