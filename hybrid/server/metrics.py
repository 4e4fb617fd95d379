"""Server counters, rendered in Prometheus' text format for GET /metrics (llama-server's set, named hybrid_*)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Metrics:
    prompt_tokens: int = 0  # evaluated prompt tokens (cached ones not counted)
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    requests: int = 0  # finished generations
    cancelled: int = 0  # generations stopped because the client went away
    rejected: int = 0  # 4xx answers
    cache_queries: int = 0
    cache_hits: int = 0  # requests that reused at least one cached token
    cache_tokens: int = 0  # prompt tokens taken from the cache
    draft_tokens: int = 0  # speculative decoding: tokens drafted and verified
    draft_accepted: int = 0  # ...of them, accepted
    # the batched worker's (-np > 1) wall time: its steps, of which the engine's eval_batch is the scheduler's
    # eval_seconds, and handing the steps' tokens to their clients (text filters, stop strings, the queues)
    worker_steps: int = 0
    worker_step_seconds: float = 0.0
    worker_deliver_seconds: float = 0.0
    # the scheduler's eval_batch time and its decode-only steps, copied with the step's own counters once a step is
    # done (read from the scheduler mid-step, they ran ahead of worker_step_seconds by that step)
    worker_eval_seconds: float = 0.0
    worker_decode_steps: int = 0
    worker_decode_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas) -> None:
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)


def _rate(n: float, s: float) -> float:
    return n / s if s > 0 else 0.0


def render(m: Metrics, gauges: dict[str, tuple[float, str]]) -> str:
    """Prometheus exposition text: the counters of m, then gauges {name: (value, help)}."""
    counters = {
        "prompt_tokens_total": (m.prompt_tokens, "counter", "Prompt tokens evaluated (cached ones not counted)."),
        "prompt_seconds_total": (m.prompt_seconds, "counter", "Time spent evaluating prompts."),
        "tokens_predicted_total": (m.predicted_tokens, "counter", "Tokens generated."),
        "tokens_predicted_seconds_total": (m.predicted_seconds, "counter", "Time spent generating."),
        "prompt_tokens_seconds": (_rate(m.prompt_tokens, m.prompt_seconds), "gauge", "Average prompt throughput in tokens/s."),
        "predicted_tokens_seconds": (_rate(m.predicted_tokens, m.predicted_seconds), "gauge",
                                     "Average generation throughput in tokens/s."),
        "requests_total": (m.requests, "counter", "Generations finished (completed, stopped or cancelled)."),
        "requests_cancelled_total": (m.cancelled, "counter", "Generations stopped because the client disconnected."),
        "requests_rejected_total": (m.rejected, "counter", "Requests answered with a client error (4xx)."),
        "prompt_cache_queries_total": (m.cache_queries, "counter", "Generations that looked up the prompt cache."),
        "prompt_cache_hits_total": (m.cache_hits, "counter", "Generations that reused cached prompt tokens."),
        "prompt_cache_tokens_total": (m.cache_tokens, "counter", "Prompt tokens taken from the cache."),
        "draft_tokens_total": (m.draft_tokens, "counter", "Speculative decoding: drafted tokens verified."),
        "draft_tokens_accepted_total": (m.draft_accepted, "counter", "Speculative decoding: drafted tokens accepted."),
        "worker_steps_total": (m.worker_steps, "counter", "Batched steps run (-np > 1)."),
        "worker_step_seconds_total": (m.worker_step_seconds, "counter",
                                      "Wall time of those steps (planning, eval_batch, sampling)."),
        "worker_deliver_seconds_total": (m.worker_deliver_seconds, "counter",
                                         "Wall time handing the steps' tokens to their clients."),
    }
    rows = []
    for name, (value, kind, help_) in counters.items():
        rows += [f"# HELP hybrid_{name} {help_}", f"# TYPE hybrid_{name} {kind}", f"hybrid_{name} {_fmt(value)}"]
    for name, (value, help_) in gauges.items():
        rows += [f"# HELP hybrid_{name} {help_}", f"# TYPE hybrid_{name} gauge", f"hybrid_{name} {_fmt(value)}"]
    return "\n".join(rows) + "\n"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


def parse(text: str) -> dict[str, float]:
    """The samples of a /metrics page as {name: value} (for tests and scripts)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
