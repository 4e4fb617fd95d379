"""Continuous batching over -np slots (llama-server's slots, vLLM's token budget): every step first gives each
decoding sequence its next token, then fills the rest of the -b budget with prompt chunks of the others in
admission order (chunked prefill: only the last one taken can be partial), and runs them all as one ragged batch
(Engine.eval_batch). Each slot owns a contiguous KV cache of n_ctx / np cells and its prompt cache (the longest
common prefix with the slot's previous conversation is reused, or, when another slot, busy or free, holds a longer
prefix of the prompt, such as a shared system prompt, its K/V rows are copied over instead of evaluated); each
sequence samples with its own parameters and seeded generator. No HTTP here: hybrid/server/batch_worker.py feeds it jobs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hybrid.generate.loop import check_fits
from hybrid.generate.sampling import Sampler, SamplingParams
from hybrid.generate.timings import Timings
from hybrid.kv.cache import KVCache
from hybrid.server.prompt_cache import PromptCache, common_prefix


MIN_SHARED_WAIT = 64  # a shared prefix shorter than this is evaluated again rather than waited for


def plan_step(remaining: Sequence[int], budget: int) -> list[int]:
    """Tokens each sequence evaluates this step. remaining[i]: 0 for a decoding sequence (it takes its one next
    token, whatever the budget), else the prompt tokens it still has to evaluate; prompts then share what is left
    of `budget` in order (admission order), so at most the last one served is cut short."""
    take = [1 if r == 0 else 0 for r in remaining]
    left = budget - sum(take)
    for i, r in enumerate(remaining):
        if r > 0 and left > 0:
            take[i] = min(r, left)
            left -= take[i]
    return take


@dataclass
class Request:
    prompt: list[int]  # token ids (never empty)
    sampling: SamplingParams
    n_predict: int  # -1: until the slot's context is full
    cache_prompt: bool = True
    logits: bool = False  # each sampled token's logits are wanted (logprobs): never only the argmax id


@dataclass(eq=False)  # compared by identity (it is found in lists)
class Seq:
    """One request in its slot (or its paged sequence): the prompt part still to evaluate, then one sampled token at
    a time."""

    req: Request
    slot: "Slot | None"  # None under the paged scheduler (paged_scheduler.py)
    n_cached: int  # prompt tokens reused from a cache
    n_done: int  # tokens of `source` whose K/V the cache holds
    sampler: Sampler
    history: list[int]
    cache: KVCache | None = None  # the KV cache it writes (its slot's, or its paged sequence)
    timings: Timings = field(default_factory=Timings)
    produced: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled and yielded, not evaluated yet
    todo: list[int] | None = None  # what to evaluate before sampling again, when not the prompt (a preempted
    # sequence's prompt and reply, recomputed: paged_scheduler)

    @property
    def source(self) -> list[int]:
        return self.req.prompt if self.todo is None else self.todo

    @property
    def remaining(self) -> int:
        return len(self.source) - self.n_done

    @property
    def cells(self) -> int:
        return self.cache.n_past


@dataclass
class Event:
    """What a step did for one sequence: a token (None: none this step) and whether it ended (finish: "stop" at
    an end-of-generation token, "length" at n_predict or a full context); logits: what the token was sampled from
    (None where only its id was asked: Request.logits False and greedy)."""

    seq: Seq
    token: int | None
    finish: str | None = None
    logits: np.ndarray | None = None


@dataclass(eq=False)
class Slot:
    index: int
    pc: PromptCache
    seq: Seq | None = None

    def held(self) -> list[int]:
        """The tokens whose K/V the slot's live cache holds now, at positions 0.. (a running sequence's evaluated
        prompt and reply, or what the last one left)."""
        if self.seq is None:
            return self.pc.ids
        return self.seq.history[: self.pc.cache.n_past]


class BatchScheduler:
    def __init__(self, engine, n_slots: int, n_batch: int, n_ctx_slot: int, cache_ram: int = 0):
        self.engine = engine
        self.n_batch = n_batch
        self.slots = [Slot(i, PromptCache(engine.new_cache(n_ctx_slot, paged=False), cache_ram // n_slots))
                      for i in range(n_slots)]
        self.running: list[Seq] = []  # admission order
        self.reused_tokens = 0  # prompt tokens not evaluated: held by the slot or copied from another (/metrics)
        self.copied_tokens = 0  # of those, copied from another slot's cache
        self.evaluated_tokens = 0  # prompt tokens evaluated
        self.eval_seconds = 0.0  # wall time inside Engine.eval_batch (/metrics: the worker's share of a step)
        self.decode_steps = 0  # steps of sampled tokens alone (no prompt rows), and their time in eval_batch
        self.decode_seconds = 0.0

    @property
    def free_slots(self) -> int:
        return sum(s.seq is None for s in self.slots)

    @property
    def busy_cells(self) -> int:
        """KV cells held by running sequences (a slot's kept prefix for later reuse not counted)."""
        return sum(s.cells for s in self.running)

    def admit(self, req: Request) -> Seq:
        """Place a request in the free slot whose cached tokens share the longest prefix with its prompt (ties: the
        lowest index); ContextTooLarge when it cannot fit that slot. Call only when free_slots > 0."""
        free = [s for s in self.slots if s.seq is None]
        slot = max(free, key=lambda s: (common_prefix(req.prompt, s.pc.ids) if req.cache_prompt else 0, -s.index))
        n_ctx = slot.pc.cache.n_ctx
        check_fits(len(req.prompt), n_ctx)
        n_cached = slot.pc.prepare(req.prompt, req.cache_prompt)
        if req.cache_prompt:  # another slot may hold a longer prefix (a shared system prompt): copy its rows
            donor, n = max(((s, common_prefix(req.prompt, s.held())) for s in self.slots if s is not slot),
                           key=lambda d: d[1], default=(None, 0))
            n = min(n, len(req.prompt) - 1)  # the last prompt token is evaluated for its logits
            if donor is not None and n > n_cached:
                n_cached = slot.pc.copy_from(donor.pc, req.prompt, n)
                self.copied_tokens += n
        self.reused_tokens += n_cached
        seq = Seq(req, slot, n_cached, n_cached, Sampler(req.sampling), list(req.prompt), slot.pc.cache)
        slot.seq = seq
        self.running.append(seq)
        return seq

    def waits_for_prefix(self, prompt: list[int]) -> bool:
        """Whether a request had better wait: a running sequence is still evaluating a prefix it shares with
        `prompt` (MIN_SHARED_WAIT tokens or more beyond what any slot holds now). Admitted once those rows exist, it
        copies them from that slot (admit) instead of evaluating them a second time, and the wait is no longer
        than that prefill: N clients sending one system prompt at once evaluate it once."""
        return prefix_in_flight(prompt, max((common_prefix(prompt, s.held()) for s in self.slots), default=0),
                                self.running)

    def release(self, seq: Seq) -> None:
        """The sequence leaves its slot (finished or cancelled); the slot keeps its tokens for prefix reuse."""
        seq.slot.pc.finish(seq.req.prompt[: seq.n_done] + seq.produced)
        seq.slot.seq = None
        self.running.remove(seq)

    def step(self, beside=None) -> list[Event]:
        """One batch over the running sequences -> an Event for each that sampled a token or finished. Finished
        sequences are released. Nothing to do: []. beside: as PagedScheduler.step's."""
        if not self.running:
            return []
        take = plan_step([s.remaining for s in self.running], self.n_batch)
        events = run_step(self.engine, list(zip(self.running, take)), self, beside)
        for ev in events:
            if ev.finish is not None:
                self.release(ev.seq)
        return events


def prefix_in_flight(prompt: list[int], have: int, running: list[Seq]) -> bool:
    """Whether one of the running sequences is still evaluating MIN_SHARED_WAIT or more tokens it shares with
    `prompt` beyond the `have` tokens of it a cache holds now (waits_for_prefix of both schedulers)."""
    for s in running:
        if s.remaining:
            shared = min(common_prefix(prompt, s.source), len(prompt) - 1)
            if shared - have >= MIN_SHARED_WAIT and s.n_done < shared:
                return True
    return False


def run_step(engine, work: list[tuple[Seq, int]], counters, beside=None) -> list[Event]:
    """One Engine.eval_batch over the sequences' next tokens (n of them each: prompt tokens of `source`, or the
    one sampled token; n = 0: not this step), then each sequence that reached its last row samples -> its Event.
    counters.evaluated_tokens counts the prompt tokens evaluated, counters.eval_seconds the time in eval_batch
    (decode_steps and decode_seconds: of the steps without prompt rows); beside goes to eval_batch (host work
    beside the step's computation)."""
    batch, want, who = [], [], []
    for s, n in work:
        if n == 0:
            continue
        if s.remaining:
            tokens = s.source[s.n_done : s.n_done + n]
            want.append(s.n_done + n == len(s.source))
        else:
            tokens = [s.next_token]
            want.append(True)
        batch.append((tokens, s.cache))
        who.append(s)
    if not batch:
        return []
    # greedy sequences that need no logits take their token's id alone (on a GPU only the ids cross back)
    ids = [s.sampler.argmax_only and not s.req.logits and s.req.n_predict != 0 for s in who]
    t0 = time.perf_counter()
    logits = engine.eval_batch(batch, want, beside=beside, ids=ids)
    ms = 1000 * (time.perf_counter() - t0)
    counters.eval_seconds += ms / 1000
    if not any(s.remaining for s in who):
        counters.decode_steps += 1
        counters.decode_seconds += ms / 1000
    events = []
    for s, (tokens, _), lg in zip(who, batch, logits):
        if s.remaining:
            s.n_done += len(tokens)
            counters.evaluated_tokens += len(tokens)
            s.timings.prompt_tokens += len(tokens)
            s.timings.prompt_ms += ms
        else:
            s.timings.eval_tokens += 1
            s.timings.eval_ms += ms
        if lg is not None:
            events.append(_sample(engine, s, lg))
    return events


def _sample(engine, s: Seq, got: np.ndarray | int) -> Event:
    """s's next token from its logits, or the id eval_batch chose (Sampler.argmax_only) -> its Event."""
    logits = got if isinstance(got, np.ndarray) else None
    if s.req.n_predict == 0:  # the prompt evaluated, nothing to generate (as generate() with n_predict 0)
        return Event(s, None, "length", logits)
    t0 = time.perf_counter()
    tok = s.sampler.sample(logits, s.history) if logits is not None else int(got)
    s.timings.sample_ms += 1000 * (time.perf_counter() - t0)
    if engine.tokenizer.is_eog(tok):
        s.next_token = None
        return Event(s, None, "stop", logits)
    s.produced.append(tok)
    s.history.append(tok)
    s.next_token = tok
    n = s.req.n_predict
    finish = "length" if (0 <= n <= len(s.produced) or s.cache.n_past >= s.cache.n_ctx) else None
    return Event(s, tok, finish, logits)
