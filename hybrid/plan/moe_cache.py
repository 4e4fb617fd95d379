"""The VRAM of the GPU cache of hot experts (`--moe-cache SLOTS|SIZE|auto`): the flag parsed, the bytes a number of
slots per layer takes in the GPU layers whose routed experts stay in RAM, and the slots a plan gives the cache.
Pure arithmetic; the runtime is hybrid/backends/moe_cache/runtime.py.

A layer's pool holds n_slots experts and one more, all zeros (the slot a missed expert reads on the GPU: its product
is exactly 0), for each of gate, up and down, at the file's per-expert stride; the lookup table is int32
(layers, n_expert)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybrid.errors import HybridError
from hybrid.system.sizes import MiB, format_size, parse_size

# auto: the plan's headroom less this (what the plan's estimates and the pool's fragmentation may miss). 512 MiB was
# too little on the H200: a 30B-A3B shape at --n-cpu-moe 48 under 12 GiB ran out of memory in its first prompt batch
AUTO_MARGIN_BYTES = 1536 * MiB
DEFAULT_POLICY = "lru"  # docs/MOE_CACHE.md: LRU ties or leads LFRU under the cap of 2, and leads it unskewed
DEFAULT_INSERTS = 2  # uploads a layer a decode step (llama.cpp PR #27861's cap; docs/MOE_CACHE.md)
_PROJ = ("gate", "up", "down")
_POOL_UNIT = 512  # as placement.POOL_UNIT (CuPy's pool rounds every allocation up to it)


class InvalidMoeCache(HybridError, ValueError):
    """A --moe-cache value that is not a slot count, a size or 'auto'."""


@dataclass(frozen=True)
class MoeCacheRequest:
    """What --moe-cache asked for: kind "off", "slots" (value a layer), "bytes" (value in all) or "auto"."""

    kind: str = "off"
    value: int = 0

    def __str__(self) -> str:
        return {"off": "0", "slots": str(self.value), "bytes": format_size(self.value, 2).replace(" ", ""),
                "auto": "auto"}[self.kind]


MOE_CACHE_OFF = MoeCacheRequest()


def parse_moe_cache(text: str | int | MoeCacheRequest | None) -> MoeCacheRequest:
    """'auto', a slot count per layer ('32'; '0' or 'off': no cache) or a total size ('6GiB') -> the request."""
    if isinstance(text, MoeCacheRequest):
        return text
    key = "" if text is None else str(text).strip().lower()
    if key in ("", "0", "off", "none"):
        return MOE_CACHE_OFF
    if key == "auto":
        return MoeCacheRequest("auto")
    if key.isdigit():
        return MoeCacheRequest("slots", int(key))
    if re.fullmatch(r"[0-9._]+\s*[kmgtp]i?b?", key):
        size = parse_size(key)
        return MoeCacheRequest("bytes", size) if size else MOE_CACHE_OFF
    raise InvalidMoeCache(f"--moe-cache takes slots per layer (32), a total size (6GiB) or 'auto', got '{text}'")


def fixed_part(req: MoeCacheRequest) -> MoeCacheRequest:
    """What a plan must reserve before it places layers: an explicit request; auto takes what is left after."""
    return MOE_CACHE_OFF if req.kind == "auto" else req


@dataclass(frozen=True)
class MoeCachePlan:
    """The cache a plan gives: slots a layer (0: off) in `layers` (GPU layers with experts in RAM), its bytes, and
    a one-line note (why it is off, or how it was sized)."""

    slots: int = 0
    bytes: int = 0
    layers: tuple[int, ...] = ()
    note: str = ""

    @property
    def on(self) -> bool:
        return self.slots > 0


def expert_bytes(tensors: Mapping, il: int) -> tuple[int, ...]:
    """Bytes of one expert of layer il's gate, up and down (objects with .shape (n_expert, ...) and .nbytes)."""
    out = []
    for p in _PROJ:
        t = tensors[f"blk.{il}.ffn_{p}_exps.weight"]
        out.append(int(t.nbytes) // int(t.shape[0]))
    return tuple(out)


def cache_bytes(tensors: Mapping, layers: Sequence[int], n_expert: int, n_slots: int) -> int:
    """Device bytes of n_slots a layer in `layers`: each projection's pool (n_slots + the zero slot), the table."""
    if n_slots <= 0 or not layers:
        return 0
    pools = sum(_pool((n_slots + 1) * e) for il in layers for e in expert_bytes(tensors, il))
    return pools + _pool(4 * len(layers) * n_expert)


def _pool(n: int) -> int:
    return -(-n // _POOL_UNIT) * _POOL_UNIT


def slots_for(tensors: Mapping, layers: Sequence[int], n_expert: int, nbytes: int) -> int:
    """The most slots a layer (at most n_expert) whose cache_bytes fit nbytes."""
    if not layers or nbytes <= 0:
        return 0
    per = sum(sum(expert_bytes(tensors, il)) for il in layers)
    n = min(n_expert, max(0, nbytes // max(per, 1)))  # an upper bound: the rounding only adds bytes
    while n > 0 and cache_bytes(tensors, layers, n_expert, n) > nbytes:
        n -= 1
    return n


def resolve(req: MoeCacheRequest, tensors: Mapping, layers: Sequence[int], n_expert: int, top_k: int,
            left_bytes: int | None = None) -> MoeCachePlan:
    """The cache of `req` over `layers`: slots as asked (at most n_expert), as many as the size holds, or (auto) as
    many as left_bytes (the plan's headroom) less AUTO_MARGIN_BYTES holds. Fewer than top_k + 1 slots a layer (a
    step's own experts are never evicted): off, with the note saying so."""
    layers = tuple(layers)
    if req.kind == "off":
        return MoeCachePlan()
    if not layers:
        return MoeCachePlan(note="moe cache off: no GPU layer keeps its routed experts in RAM")
    if req.kind == "slots":
        n, how = min(req.value, n_expert), f"{req.value} slots a layer asked"
    elif req.kind == "bytes":
        n, how = slots_for(tensors, layers, n_expert, req.value), f"{format_size(req.value, 2)} asked"
    else:
        left = max(0, (left_bytes or 0) - AUTO_MARGIN_BYTES)
        n, how = slots_for(tensors, layers, n_expert, left), (f"auto: {format_size(left, 2)} left after the plan and "
                                                             f"a {format_size(AUTO_MARGIN_BYTES)} margin")
    if n < top_k + 1:
        return MoeCachePlan(note=f"moe cache off: {how} gives {n} slots a layer, fewer than top_k + 1 = {top_k + 1}")
    nbytes = cache_bytes(tensors, layers, n_expert, n)
    return MoeCachePlan(n, nbytes, layers, f"moe cache: {n} slots a layer in {len(layers)} layers "
                                           f"({format_size(nbytes, 2)}; {how})")

