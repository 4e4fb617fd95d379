"""One generation in the slot (the worker thread): reuse the cached prefix, generate, and turn tokens into
deltas: complete UTF-8 only (TextStream), stop strings cut and never leaked, <think> split off, tool calls held
back, streamed as they are written and parsed; then the usage, llama.cpp-style timings and the counters."""

from __future__ import annotations

import numpy as np

from hybrid.generate.sampling import log_softmax, top_k
from hybrid.generate.speculative import SpecStats
from hybrid.generate.timings import Timings
from hybrid.server.holdback import StopStrings
from hybrid.server.reasoning import ReasoningSplitter
from hybrid.server.slot import Delta, Final, Job
from hybrid.server.toolcall_stream import ToolCallCatcher
from hybrid.text.harmony import HarmonySplitter, is_harmony
from hybrid.text.stream import TextStream


class LogitsTap:
    """The engine, with the logits of its last eval kept: when generate() yields a token, `last` holds the
    logits it was sampled from."""

    def __init__(self, engine):
        self._engine = engine
        self.last = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def eval(self, tokens, cache, logits_from=None):
        self.last = self._engine.eval(tokens, cache, logits_from)
        return self.last


def logprob_entry(tok, logits: np.ndarray, token: int, n_top: int) -> dict:
    """OpenAI's logprobs entry of one sampled token (raw model distribution, before the sampler's cuts)."""
    lsm = log_softmax(logits)

    def one(t: int) -> dict:
        b = tok.piece_bytes(int(t), special=False)
        return {"token": b.decode("utf-8", "replace"), "logprob": float(lsm[t]), "bytes": list(b)}

    entry = one(token)
    entry["top_logprobs"] = [one(t) for t in top_k(logits, n_top)[0]] if n_top else []
    return entry


class Output:
    """Tokens in, deltas out: the text filters in the order they apply."""

    def __init__(self, job: Job, tokenizer, reasoning: bool, harmony: bool = False):
        chat = job.req.kind == "chat"
        harmony = harmony and chat  # gpt-oss's channels: read with their markers written out, then split
        self.job = job
        self.reasoning = reasoning
        self.text = TextStream(tokenizer, special=harmony)
        self.stops = StopStrings(job.req.stop)
        self.think = HarmonySplitter() if harmony else ReasoningSplitter(chat and reasoning, job.opens_think)
        names = {t["function"]["name"] for t in job.req.tools}
        self.tools = ToolCallCatcher(chat and bool(job.req.tools), names)
        self.logprobs: list = []

    def push(self, token: int, logprob: dict | None) -> bool:
        """Add one token; True when a stop string ended the reply."""
        if logprob is not None:
            self.logprobs.append(logprob)
        self._emit(self.stops.push(self.text.push(token)))
        return self.stops.stopped

    def _emit(self, text: str, final: bool = False) -> None:
        parts = self.think.push(text) + (self.think.flush() if final else [])
        if not self.reasoning:  # --reasoning-format none: harmony's analysis channel stays in the content
            parts = [("content", t) for _, t in parts]
        reasoning = "".join(t for k, t in parts if k == "reasoning")
        content = self.tools.push("".join(t for k, t in parts if k == "content"))
        calls = self.tools.deltas()
        if content or reasoning or calls or (final and self.logprobs):
            self.job.post(Delta(content, reasoning, self.logprobs, calls))
            self.logprobs = []

    def finish(self) -> list[dict]:
        """Flush what was held back; the tool calls found."""
        tail = "" if self.stops.stopped else self.stops.push(self.text.flush())
        self._emit(tail + self.stops.flush(), final=True)
        rest, calls = self.tools.finish()
        tail = self.tools.deltas()
        if rest or tail or self.logprobs:
            self.job.post(Delta(rest, "", self.logprobs, tail))
            self.logprobs = []
        return calls


def run_job(state, job: Job) -> None:
    """Run one queued request to its end (or until its client goes away) and post its events."""
    req, engine, pc = job.req, state.engine, state.prompt_cache
    ids = job.prompt_ids
    n_cached = pc.prepare(ids, req.cache_prompt)
    timings = Timings()
    tap = LogitsTap(engine) if req.logprobs else engine
    out = Output(job, engine.tokenizer, state.config.reasoning_format != "none", is_harmony(state.template.source))
    produced: list[int] = []
    finish, cancelled = None, False
    spec = SpecStats() if state.speculator is not None and not req.logprobs else None
    if spec is None:
        gen = state.generate(tap, ids[n_cached:], req.sampling, req.max_tokens, pc.cache, timings)
    else:  # logprobs need the logits each token was sampled from: those requests decode plainly
        gen = state.speculator.generate(engine, ids[n_cached:], req.sampling, req.max_tokens, pc.cache, timings,
                                        prefix=ids[:n_cached], stats=spec)
    try:
        for t in gen:
            produced.append(t)
            lp = logprob_entry(engine.tokenizer, tap.last, t, req.top_logprobs) if req.logprobs else None
            if out.push(t, lp):
                finish = "stop"
                break
            if job.cancel.is_set():
                cancelled = True
                break
    finally:
        gen.close()
        pc.finish(ids + produced)
    if finish is None:
        full = pc.cache.n_past >= pc.cache.n_ctx
        finish = "length" if (len(produced) == req.max_tokens or full) else "stop"
    close_job(state, job, out, finish, len(produced), n_cached, timings, cancelled, spec)


def close_job(state, job: Job, out: Output, finish: str, n_produced: int, n_cached: int, timings: Timings,
              cancelled: bool, spec: SpecStats | None = None) -> None:
    """A generation's end: flush the held-back text, count it in /metrics, post the Final (usage and timings)."""
    n_prompt = len(job.prompt_ids)
    calls = out.finish()
    if calls:
        finish = "tool_calls"
    gen_ms = timings.eval_ms + timings.sample_ms
    state.metrics.add(prompt_tokens=timings.prompt_tokens, prompt_seconds=timings.prompt_ms / 1000,
                      predicted_tokens=n_produced, predicted_seconds=gen_ms / 1000, requests=1,
                      cancelled=int(cancelled), cache_queries=1, cache_hits=int(n_cached > 0), cache_tokens=n_cached)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_produced, "total_tokens": n_prompt + n_produced,
             "prompt_tokens_details": {"cached_tokens": n_cached}}
    if spec is not None:
        state.metrics.add(draft_tokens=spec.drafted, draft_accepted=spec.accepted)
    job.post(Final(finish, calls, usage, llama_timings(n_cached, timings, n_produced, gen_ms, spec)))


def llama_timings(n_cached: int, t: Timings, n_predicted: int, gen_ms: float, spec: SpecStats | None = None) -> dict:
    """llama-server's `timings` object (with draft_n and draft_n_accepted when the reply was drafted)."""
    extra = {} if spec is None else {"draft_n": spec.drafted, "draft_n_accepted": spec.accepted}
    return {
        **extra,
        "cache_n": n_cached,
        "prompt_n": t.prompt_tokens, "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_ms / t.prompt_tokens if t.prompt_tokens else 0.0,
        "prompt_per_second": Timings.rate(t.prompt_tokens, t.prompt_ms),
        "predicted_n": n_predicted, "predicted_ms": gen_ms,
        "predicted_per_token_ms": gen_ms / n_predicted if n_predicted else 0.0,
        "predicted_per_second": Timings.rate(n_predicted, gen_ms),
    }

