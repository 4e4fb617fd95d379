"""The server's state, in one object the app holds (no globals): the configuration, the engine once loaded, the
chat template, the slot's queue, the prompt cache and the counters."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid.generate.loop import generate
from hybrid.kv.paged import supports_paging
from hybrid.server.metrics import Metrics
from hybrid.server.paged_scheduler import PagedScheduler
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
    # -np > 1: the batching over one paged cache (backends that read block tables) or a cache a slot; None: one
    scheduler: PagedScheduler | BatchScheduler | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def n_ctx(self) -> int:
        """A request's context in tokens (-c, or -c / -np with -np > 1)."""
        if isinstance(self.scheduler, PagedScheduler):
            return self.scheduler.n_ctx_slot
        return self.prompt_cache.cache.n_ctx

    @property
    def kv_bytes(self) -> int:
        """The KV cache's bytes: the paged pool, or every slot's cache."""
        if isinstance(self.scheduler, PagedScheduler):
            return self.scheduler.kv.nbytes
        return self.prompt_cache.cache.nbytes * self.config.n_parallel

    def attach(self, engine) -> None:
        """The loaded engine: its chat template chosen and the KV caches made (-np N: one paged pool of n_ctx cells
        where every layer's backend reads block tables (the CPU's, the GPU's), else N caches of n_ctx / N cells,
        prompt_cache then the first slot's)."""
        self.template = choose_template(engine.gguf.metadata, engine.config.arch, self.config.chat_template)
        c = self.config
        if c.n_parallel > 1 and supports_paging(engine.backends):
            self.scheduler = PagedScheduler(engine, c.n_parallel, engine.params.n_batch,
                                            engine.params.n_ctx // c.n_parallel, engine.params.n_ctx)
        elif c.n_parallel > 1:  # a backend without block tables: a contiguous cache a slot
            self.scheduler = BatchScheduler(engine, c.n_parallel, engine.params.n_batch,
                                            engine.params.n_ctx // c.n_parallel, c.cache_ram)
            self.prompt_cache = self.scheduler.slots[0].pc
        else:
            self.prompt_cache = PromptCache(engine.new_cache(), c.cache_ram)  # paged where the backends read tables
        self.engine = engine
