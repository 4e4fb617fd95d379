"""The generation worker of `hybrid serve -np N` (N > 1): queued jobs enter free slots of the BatchScheduler as they
come (one whose prompt shares a long prefix with a prompt still being evaluated waits for those rows, then copies
them), every step advances all of them at once, and each job's tokens go through its own Output (the text filters
of the single slot, runner.Output) to its client. A job whose client left is released within one step; a failed
step fails the jobs it held and frees their slots. Speculative decoding stays on the single-slot path (-np 1)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from hybrid.errors import HybridError
from hybrid.server.arrivals import Arrivals, near_end
from hybrid.server.runner import Output, close_job, logprob_entry
from hybrid.server.scheduler import BatchScheduler, Event, Request, Seq
from hybrid.server.slot import Failure, Job, Outbox
from hybrid.text.harmony import is_harmony


@dataclass
class Running:
    job: Job
    out: Output
    seq: Seq


def serve_batched(state, sched: BatchScheduler, stop: threading.Event, poll_s: float = 0.2) -> None:
    """Run jobs from state.slots through `sched` until `stop` is set. The running jobs' events wait in an Outbox
    and go to the clients' loop once a step, while the next step computes (Engine.eval_batch's `beside`); arrivals
    expected to come in a wave are gathered for it (arrivals.py)."""
    outbox, arrivals = Outbox(), Arrivals()
    try:
        _serve(state, sched, stop, poll_s, outbox, arrivals)
    finally:
        outbox.flush()
        state.slots.running = 0
        for job in arrivals.release(len(arrivals.gathered)):  # taken from the queue, never admitted
            job.post(Failure("the server is stopping"))
            job.finished.set()


def _serve(state, sched: BatchScheduler, stop: threading.Event, poll_s: float, outbox: Outbox,
           arrivals: Arrivals) -> None:
    jobs: dict[int, Running] = {}  # id(seq) -> its job
    held: list[Job] = []  # jobs waiting for a running prompt's shared prefix (BatchScheduler.waits_for_prefix)
    while not stop.is_set():
        for job in list(held):  # in arrival order, once the rows they share exist (or their client left)
            if not sched.free_slots:
                break
            if job.cancel.is_set() or not sched.waits_for_prefix(job.prompt_ids):
                held.remove(job)
                _admit(state, sched, job, jobs, outbox)
        near = sum(near_end(r.seq) for r in jobs.values())
        while len(arrivals.gathered) < sched.free_slots:  # take what waits; block only when nothing runs
            idle = not (jobs or held)
            wait = arrivals.wait_s(sched.free_slots, near, sched.n_batch)
            job = state.slots.take(0 if not idle else wait if arrivals.gathered else poll_s)
            if job is None:
                break
            arrivals.gather(job, len(job.prompt_ids))
        if arrivals.wait_s(sched.free_slots, near, sched.n_batch) == 0:
            for job in arrivals.release(sched.free_slots):
                if job.req.cache_prompt and sched.waits_for_prefix(job.prompt_ids):
                    held.append(job)
                    continue
                _admit(state, sched, job, jobs, outbox)
        state.slots.running = len(jobs)
        for key in [k for k, r in jobs.items() if r.job.cancel.is_set()]:  # clients gone: free their slots
            sched.release(jobs[key].seq)
            _close(state, jobs, key, "stop", cancelled=True)
        if not jobs:
            outbox.flush()
            continue
        t0 = time.perf_counter()
        try:
            events = sched.step(beside=outbox.flush)
        except Exception as exc:  # noqa: BLE001 - reported to each client; the slots go on serving
            for key in list(jobs):
                _fail(state, sched, jobs, key, exc)
            continue
        finally:
            outbox.flush()  # a step that launched nothing did not flush
        t1 = time.perf_counter()
        n_jobs = len(jobs)
        for ev in events:
            _deliver(state, sched, jobs, ev)
        for _ in range(n_jobs - len(jobs)):  # replies that ended: their clients may come back soon
            arrivals.reply_ended()
        if not jobs:  # no next step to flush them beside (the admissions may block for poll_s)
            outbox.flush()
        m = state.metrics  # written by this thread alone: no lock
        m.worker_steps += 1
        m.worker_step_seconds += t1 - t0
        m.worker_deliver_seconds += time.perf_counter() - t1
        m.worker_eval_seconds = sched.eval_seconds
        m.worker_decode_steps, m.worker_decode_seconds = sched.decode_steps, sched.decode_seconds


def _admit(state, sched: BatchScheduler, job: Job, jobs: dict, outbox: Outbox) -> None:
    if job.cancel.is_set():  # the client left while it waited
        job.finished.set()
        return
    job.started.set()
    req = job.req
    try:
        seq = sched.admit(Request(job.prompt_ids, req.sampling, req.max_tokens, req.cache_prompt, req.logprobs))
    except HybridError as exc:
        job.post(Failure(str(exc)))
        job.finished.set()
        return
    out = Output(job, state.engine.tokenizer, state.config.reasoning_format != "none",
                 is_harmony(state.template.source))
    job.outbox = outbox
    jobs[id(seq)] = Running(job, out, seq)


def _deliver(state, sched: BatchScheduler, jobs: dict, ev: Event) -> None:
    """One sequence's step result to its job: the token through its Output (a stop string ends the reply), and
    its end when it ended. A failure here fails that job alone."""
    key = id(ev.seq)
    r = jobs[key]
    finish = ev.finish
    try:
        if ev.token is not None:
            req = r.job.req
            lp = logprob_entry(state.engine.tokenizer, ev.logits, ev.token, req.top_logprobs) if req.logprobs else None
            if r.out.push(ev.token, lp):  # a stop string ended the reply
                if finish is None:
                    sched.release(ev.seq)
                finish = "stop"
    except Exception as exc:  # noqa: BLE001 - reported to this client; the others go on
        _fail(state, sched, jobs, key, exc)
        return
    if finish is not None:
        _close(state, jobs, key, finish)


def _fail(state, sched: BatchScheduler, jobs: dict, key: int, exc: Exception) -> None:
    r = jobs.pop(key)
    if r.seq in sched.running or r.seq in getattr(sched, "preempted", ()):
        sched.release(r.seq)
    state.slots.running = len(jobs)
    r.job.post(Failure(f"{type(exc).__name__}: {exc}"))
    r.job.finished.set()


def _close(state, jobs: dict, key: int, finish: str, cancelled: bool = False) -> None:
    """Job `key` leaves `jobs` (its slot already released): its counters, its Final, and its end."""
    r = jobs.pop(key)
    state.slots.running = len(jobs)  # before the client hears of the end
    try:
        close_job(state, r.job, r.out, finish, len(r.seq.produced), r.seq.n_cached, r.seq.timings, cancelled)
    finally:
        r.job.finished.set()
