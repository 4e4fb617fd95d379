"""`hybrid bench --moe-cache LIST`: the expert cache as a swept setting (e.g. `--moe-cache auto,0` compares a run
with the cache and without it on the same placement) and its fields in each row, counted over that row's test."""

from __future__ import annotations

import numpy as np
import typer

from hybrid.backends.moe_cache.runtime import expert_cache
from hybrid.errors import HybridError
from hybrid.plan.moe_cache import MoeCacheRequest, parse_moe_cache


def cache_sweep(text: str) -> list[MoeCacheRequest]:
    """'auto,0,32,6GiB' -> the requests, in order (a usage error for a bad one)."""
    try:
        out = [parse_moe_cache(v) for v in text.split(",") if v.strip()]
    except HybridError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--moe-cache'") from None
    return out or [parse_moe_cache("0")]


def cache_counts(engine) -> np.ndarray | None:
    """(hits, lookups, uploads, upload bytes, decode tokens) of the engine's cache so far (None: no cache)."""
    c = expert_cache(engine)
    if c is None:
        return None
    s = c.book.stats
    return np.array([s.hits.sum(), s.lookups.sum(), s.uploads.sum(), s.upload_bytes.sum(), s.tokens],
                    dtype=np.int64)


def cache_fields(engine, req: MoeCacheRequest, before: np.ndarray | None) -> dict:
    """A row's fields: moe_cache (as asked), its slots a layer, and over the row's test (counts since `before`)
    the decode hit rate (None without lookups), uploads and bytes per decode token; moe_cache_report: the whole
    run's line."""
    c = expert_cache(engine)
    now = cache_counts(engine)
    fields = {"moe_cache": str(req), "moe_cache_slots": 0 if c is None else c.n_slots, "moe_cache_hit_rate": None,
              "moe_cache_uploads_per_token": None, "moe_cache_bytes_per_token": None,
              "moe_cache_report": "" if c is None else c.book.summary()}
    if now is None:
        return fields
    hits, lookups, ups, nbytes, tokens = now - (before if before is not None else 0)
    if lookups:
        fields["moe_cache_hit_rate"] = float(hits / lookups)
    if tokens:
        fields["moe_cache_uploads_per_token"] = float(ups / tokens)
        fields["moe_cache_bytes_per_token"] = float(nbytes / tokens)
    return fields


def cache_note(row: dict) -> str:
    """', cache auto: 83.1% hits' for the md progress line ('' without a cache)."""
    if row.get("moe_cache", "0") == "0":
        return ""
    rate = row.get("moe_cache_hit_rate")
    return f", moe cache {row['moe_cache']}: " + ("off" if not row["moe_cache_slots"] else
                                                   f"{row['moe_cache_slots']} slots, "
                                                   + ("no decode" if rate is None else f"{rate:.1%} hits"))
