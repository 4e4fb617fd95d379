"""Speculative decoding for one request: a drafter guesses tokens, the target verifies them in one batch.

Verification follows llama.cpp (`common_sampler_sample_and_accept_n`): the target evaluates
[last, d1..dk] with logits at every position, samples each position with the full sampler chain, accepts while the
sample equals the draft, emits its own sample at the first mismatch, and a bonus token when all k match. Each emitted
token costs exactly one draw and enters the penalty history only once emitted, so the output has the target's
distribution (with a fixed seed: the same tokens as plain decoding, up to the float sums of a batch). The KV cache
rolls back to the accepted length by setting n_past: attention reads positions [0, n_past) only and later writes
overwrite the rejected cells (tests/test_speculative.py checks it).

Adaptive draft length (DraftLength): the acceptance per draft token and the cost of a verification batch are
measured as it runs (decayed averages; cost(n) = t1 + slope * (n - 1), t1 from one-token steps), and each step drafts
the k in [draft_min, draft_max] that maximises the expected tokens per millisecond, (1 - a^(k+1)) / (1 - a) / cost(k),
or nothing when a plain step does better; while off, a short draft now and then re-measures the acceptance (every
PROBE_EVERY steps, or less often where a check costs more than PROBE_BUDGET of the plain steps would allow).
On a GPU the checks run as CUDA graphs of a few batch sizes (Engine.draft_lengths, prepared once per cache shape by
Engine.prepare_checks), the draft lengths limited to them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hybrid.engine.engine import Engine
from hybrid.generate.draft import Drafter
from hybrid.generate.loop import eval_prompt
from hybrid.generate.sampling import Sampler, SamplingParams
from hybrid.generate.timings import Timings
from hybrid.kv.cache import KVCache


PROBE_EVERY = 32  # while speculation does not pay: one draft of draft_min tokens in this many steps at least...
PROBE_BUDGET = 0.01  # ...and in as many more as keep the probes' extra cost within this share of the plain steps
LEARN_MAX = 4  # the first draft (the one that measures a check's cost) is at most this long
# a draft must promise this much more speed than a plain step: the acceptance is estimated from few tokens, and
# where drafting only breaks even (a check costing half a step, half the drafts accepted) the noise made it lose
PAY_MARGIN = 1.05
DECAY = 0.9  # weight of the past in the running acceptance and cost estimates


class DraftLength:
    """Chooses each step's draft length from the measured acceptance and verification cost (0: no draft).

    lengths: the draft lengths allowed (None: any from k_min to k_max); a GPU allows those whose check runs as one
    CUDA graph of a few sizes (Engine.draft_lengths), so that every size it tries is captured once."""

    def __init__(self, k_min: int, k_max: int, lengths: Sequence[int] | None = None):
        self.k_min, self.k_max = max(k_min, 1), k_max
        allowed = range(self.k_min, k_max + 1) if lengths is None else lengths
        self.lengths = sorted(k for k in allowed if self.k_min <= k <= k_max) or [self.k_min]
        self.hits, self.trials = 0.0, 0.0  # decayed counts of accepted / verified draft tokens
        self.t1: float | None = None  # ms of a one-token step
        self.slope: float | None = None  # ms per extra token in a verification batch
        self.idle = 0  # steps since the last draft

    @property
    def alpha(self) -> float:
        return (self.hits + 0.5) / (self.trials + 1.0)  # a weak prior (0.5, one token's worth) before any draft

    def choose(self) -> int:
        if self.t1 is None:
            return 0  # measure a plain step first
        if self.slope is None:  # the cost of a check unknown: draft to learn it
            return max([k for k in self.lengths if k <= LEARN_MAX] or self.lengths[:1])
        a = min(self.alpha, 0.999)
        best_k, best = 0, PAY_MARGIN / self.t1
        for k in self.lengths:
            rate = (1.0 - a ** (k + 1)) / (1.0 - a) / (self.t1 + self.slope * k)
            if rate > best:
                best_k, best = k, rate
        probe_every = max(PROBE_EVERY, self.slope * self.lengths[0] / (PROBE_BUDGET * self.t1))
        if best_k == 0 and self.idle >= probe_every:
            return self.lengths[0]
        return best_k

    def observe(self, n_draft: int, n_ok: int, ms: float) -> None:
        """One step: a draft of n_draft tokens (0: a plain step), n_ok accepted, the eval took ms."""
        if n_draft == 0:
            self.idle += 1
            self.t1 = ms if self.t1 is None else DECAY * self.t1 + (1 - DECAY) * ms
            return
        self.idle = 0
        self.hits = DECAY * self.hits + n_ok
        self.trials = DECAY * self.trials + n_ok + (n_ok < n_draft)  # tokens up to the first rejection
        if self.t1 is not None:
            s = max(0.0, (ms - self.t1) / n_draft)
            self.slope = s if self.slope is None else DECAY * self.slope + (1 - DECAY) * s


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of them, accepted
    drafts: int = 0  # verification batches that carried a draft
    steps: int = 0  # target evaluations after the prompt (with or without a draft)
    drafted_at: list[int] = field(default_factory=list)  # per draft position: how often it was verified
    accepted_at: list[int] = field(default_factory=list)  # ...and accepted
    draft_ms: float = 0.0  # time spent drafting (inside the eval time)
    rows_skipped: int = 0  # positions after a rejection whose logits were never computed

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted tokens per verified draft."""
        return self.accepted / self.drafts if self.drafts else 0.0

    def record(self, n_draft: int, n_accepted: int) -> None:
        self.drafted += n_draft
        self.accepted += n_accepted
        self.drafts += 1
        while len(self.drafted_at) < n_draft:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_draft):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    def merge(self, other: SpecStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.drafts += other.drafts
        self.steps += other.steps
        self.draft_ms += other.draft_ms
        self.rows_skipped += other.rows_skipped
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            if i == len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": self.rate,
                "drafts": self.drafts, "mean_accepted": self.mean_accepted, "steps": self.steps,
                "draft_ms": self.draft_ms, "rows_skipped": self.rows_skipped,
                "acceptance_at": [a / d for a, d in zip(self.accepted_at, self.drafted_at)]}


def generate_speculative(engine: Engine, prompt: list[int], sampling: SamplingParams, n_predict: int,
                         cache: KVCache, drafter: Drafter, draft_max: int = 8, draft_min: int = 1,
                         timings: Timings | None = None, stats: SpecStats | None = None,
                         adaptive: bool = True, prefix: Sequence[int] = (),
                         length: DraftLength | None = None) -> Iterator[int]:
    """As generate.loop.generate (same stopping rules), with drafts verified in one batch per step.

    prefix: the tokens the cache already holds before `prompt` (a chat's earlier turns, a server's cached prompt):
    the drafter sees them, the sampler's penalties do not (as in plain decoding). timings.eval_tokens counts the
    generated tokens whose evaluation was kept (rejected drafts are not counted) and timings.eval_ms includes the
    drafting, so its tokens per second is the decode speed a user sees; stats (drafted, accepted, …) are filled as
    it runs. adaptive=False drafts up to draft_max every step (what the tests of exactness use); length: the
    adaptive state to continue (a Speculator keeps one across requests), else a fresh one."""
    timings = timings if timings is not None else Timings()
    stats = stats if stats is not None else SpecStats()
    logits = eval_prompt(engine, prompt, cache, timings)
    sampler = Sampler(sampling)
    history = list(prompt)  # the penalties' window, as plain decoding's
    context = [*prefix, *prompt]  # the whole sequence, for the drafter
    k_min = max(draft_min, 1)
    if adaptive and length is None:
        length = DraftLength(k_min, draft_max, engine.draft_lengths(draft_max))
    elif not adaptive:
        length = None
    t0 = time.perf_counter()
    engine.prepare_checks(cache, length.lengths if length is not None else [draft_max])
    prefill = getattr(drafter, "prefill", None)  # a draft model reads the prompt now, not at the first draft
    if prefill is not None and n_predict != 0:
        prefill([*prefix, *prompt])
    # counted as the prompt's: the checks' graphs captured (once per cache shape), the draft model's prompt
    timings.prompt_ms += 1000 * (time.perf_counter() - t0)
    produced = 0
    pending: int | None = None  # a token already drawn at verification (the mismatch or the bonus)
    while n_predict < 0 or produced < n_predict:
        if pending is None:
            t0 = time.perf_counter()
            try:
                pending = sampler.sample(logits, history)
            finally:
                timings.sample_ms += 1000 * (time.perf_counter() - t0)
        tok, pending = pending, None
        if engine.tokenizer.is_eog(tok):
            return
        yield tok
        produced += 1
        history.append(tok)
        context.append(tok)
        if (n_predict >= 0 and produced >= n_predict) or cache.n_past >= cache.n_ctx:
            return
        room = cache.n_ctx - cache.n_past - 1  # draft tokens that fit after tok
        if n_predict >= 0:
            room = min(room, n_predict - produced - 1)  # accepted drafts + the bonus never pass n_predict
        k = length.choose() if length is not None else draft_max
        t0 = time.perf_counter()
        try:
            draft = drafter.propose(context, min(k, room)) if k >= k_min and room >= k_min else []
            if len(draft) < k_min:
                draft = []
            t_draft = time.perf_counter()
            rows = engine.eval_rows([tok, *draft], cache)  # 1 + len(draft) rows, each computed when read
            timings.eval_tokens += 1
        finally:
            t1 = time.perf_counter()
            ms = 1000 * (t1 - t0)
            timings.eval_ms += ms
        stats.draft_ms += 1000 * (t_draft - t0)
        stats.steps += 1
        if not draft:
            logits = rows[-1]
            if length is not None:
                length.observe(0, 0, ms)
            continue
        base = cache.n_past - len(draft)  # tok's position + 1: where d1 sits
        n_ok = 0
        t0 = time.perf_counter()
        for i, d in enumerate(draft):
            t = sampler.sample(rows[i], history)
            if t != d:
                pending = t  # the target's own token at the first mismatch
                break
            n_ok += 1
            if engine.tokenizer.is_eog(t):
                break
            history.append(t)
        else:
            pending = sampler.sample(rows[len(draft)], history)  # the bonus token
        head_ms = rows.ms  # the output layer's rows, computed as they were read
        timings.sample_ms += 1000 * (time.perf_counter() - t0) - head_ms
        timings.eval_ms += head_ms
        cache.n_past = base + n_ok  # rollback: the rejected cells are overwritten by later writes
        stats.record(len(draft), n_ok)
        stats.rows_skipped += len(rows) - rows.computed
        if length is not None:
            length.observe(len(draft), n_ok, ms + head_ms)
        timings.eval_tokens += n_ok
        for t in draft[:n_ok]:
            if engine.tokenizer.is_eog(t):
                return
            yield t
            context.append(t)
            produced += 1
            if n_predict >= 0 and produced >= n_predict:
                return


@dataclass
class Speculator:
    """A drafter with its settings, reused across generations (`run`, a chat's turns, a server's requests): the
    adaptive draft length carries over, and `stats` totals every generation's counts."""

    drafter: Drafter
    draft_max: int = 8
    draft_min: int = 1
    adaptive: bool = True
    stats: SpecStats = field(default_factory=SpecStats)
    length: DraftLength | None = None

    def generate(self, engine: Engine, prompt: list[int], sampling: SamplingParams, n_predict: int,
                 cache: KVCache, timings: Timings | None = None, prefix: Sequence[int] = (),
                 stats: SpecStats | None = None) -> Iterator[int]:
        """generate_speculative with this drafter; stats (optional) gets this generation's counts alone."""
        own = stats if stats is not None else SpecStats()
        if self.adaptive and self.length is None:
            self.length = DraftLength(max(self.draft_min, 1), self.draft_max, engine.draft_lengths(self.draft_max))
        try:
            yield from generate_speculative(engine, prompt, sampling, n_predict, cache, self.drafter,
                                            self.draft_max, self.draft_min, timings, own, self.adaptive, prefix,
                                            self.length)
        finally:
            self.stats.merge(own)
