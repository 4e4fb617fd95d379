"""The server's state, in one object the app holds (no globals): the configuration, the engine once loaded, the
chat template, the slot's queue, the prompt cache and the counters."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid.generate.loop import generate
from hybrid.server.metrics import Metrics
from hybrid.server.prompt_cache import PromptCache
from hybrid.server.scheduler import BatchScheduler
from hybrid.server.slot import SlotQueue
from hybrid.text.chat_template import ChatTemplate, choose_template

DEFAULT_MAX_BODY = 8 << 20  # bytes; a bigger request body is refused with 413


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    alias: str  # the model's name in /v1/models and responses
    api_key: str | None = None  # None: no key asked
    cache_ram: int = 2 << 30  # bytes of host RAM for saved prompt states (0: only the live cache)
    reasoning_format: str = "deepseek"  # none | deepseek | auto
    chat_template: str | None = None  # a built-in name or a jinja2 file (None: the GGUF's)
    max_body: int = DEFAULT_MAX_BODY
    n_parallel: int = 1  # -np: slots; above 1, continuous batching (server/scheduler.py), the context split evenly


@dataclass
class ServerState:
    config: ServerConfig
    engine: object = None  # hybrid.engine.Engine once loaded; None while loading (/health says 503)
    template: ChatTemplate | None = None
    prompt_cache: PromptCache | None = None
    slots: SlotQueue = field(default_factory=SlotQueue)
    metrics: Metrics = field(default_factory=Metrics)
    generate: Callable = generate  # hybrid.generate.loop.generate; tests may script the model's tokens
    speculator: object = None  # hybrid.generate.speculative.Speculator (--spec-type, -md); None: plain decoding
    scheduler: BatchScheduler | None = None  # -np > 1: the slots and their batching; None: the single slot
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def attach(self, engine) -> None:
        """The loaded engine: its chat template chosen and the slots' KV caches made (-np N: N caches of n_ctx / N
        cells; prompt_cache is then the first slot's, which says the per-slot context)."""
        self.template = choose_template(engine.gguf.metadata, engine.config.arch, self.config.chat_template)
        c = self.config
        if c.n_parallel > 1:
            self.scheduler = BatchScheduler(engine, c.n_parallel, engine.params.n_batch,
                                            engine.params.n_ctx // c.n_parallel, c.cache_ram)
            self.prompt_cache = self.scheduler.slots[0].pc
        else:
            self.prompt_cache = PromptCache(engine.new_cache(), c.cache_ram)
        self.engine = engine
