"""The KV cache of one conversation: one storage per layer, made by the backend that runs that layer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gguf_io import ModelConfig


@dataclass
class KVCache:
    n_ctx: int
    type_k: str
    type_v: str
    layers: list = field(default_factory=list)
    n_past: int = 0  # positions [0, n_past) hold valid entries

    @classmethod
    def create(cls, config: ModelConfig, backends: list, n_ctx: int, type_k: str = "f16",
               type_v: str = "f16") -> "KVCache":
        """backends[il] allocates layer il's storage (CPU numpy or GPU memory)."""
        return cls(n_ctx, type_k, type_v, [_new_layer(be, config, n_ctx, type_k, type_v) for be in backends])

    def clear(self) -> None:
        self.n_past = 0

    def reserve(self, n_tokens: int) -> None:
        """Storage for positions [0, n_tokens), asked for before a batch is computed: a contiguous cache has it all
        from the start (a paged one, kv.paged.PagedCache, takes blocks here)."""

    @property
    def paged(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(int(layer.nbytes) for layer in self.layers)


def _new_layer(be, config: ModelConfig, n_ctx: int, type_k: str, type_v: str):
    """One layer's storage. MLA (deepseek2): one row per token, [latent | rope key] (key_length wide, of type_k),
    which is both the key and, read whole, the value (the attention keeps the latent part): llama.cpp's K-only
    cache, the same bytes hybrid.plan.placement.kv_bytes_per_cell counts."""
    if config.n_lora_kv:
        hd = config.n_embd_head_k
        layer = be.new_kv_layer(n_ctx, config.n_head_kv, hd, hd, type_k, type_k)
        return replace(layer, v=layer.k)
    return be.new_kv_layer(n_ctx, config.n_head_kv, config.n_embd_head_k, config.n_embd_head_v, type_k, type_v)
