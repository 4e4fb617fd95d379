"""The one generation slot and its fair queue: requests wait in arrival order (a queue.Queue) and one worker
thread runs them one at a time; results travel back to the request's event loop as events. A request whose client
went away is skipped if still queued, or stopped within one token if running."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid.server.schemas import GenRequest


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    logprobs: list = field(default_factory=list)  # one entry per token this delta closes
    tool_calls: list = field(default_factory=list)  # streamed `tool_calls` delta entries (the chat stream only)


@dataclass
class Final:
    finish_reason: str  # stop | length | tool_calls
    tool_calls: list[dict]
    usage: dict
    timings: dict


@dataclass
class Failure:
    message: str


@dataclass
class Job:
    req: GenRequest
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    opens_think: bool = False  # the rendered prompt ends inside <think>
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    outbox: "Outbox | None" = None  # the batched worker's: events wait there for its next flush

    def post(self, event) -> None:
        """From the worker thread: hand an event to the request's loop (a closed loop cancels the job), or to the
        worker's outbox when the job has one."""
        if self.outbox is not None:
            self.outbox.items.append((self, event))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancel.set()

    async def next_event(self):
        return await self.events.get()


class Outbox:
    """Events of several jobs handed to their loops together: one call_soon_threadsafe a loop per flush instead of
    one an event. Each hand-over wakes the loop's thread, which takes the interpreter lock as soon as the worker
    lets it go and keeps it for its burst of work (the SSE chunks, the sockets); the batched worker flushes once a
    step, after it has launched the next step's GPU work, so that burst runs while the GPU computes instead of
    between steps."""

    def __init__(self) -> None:
        self.items: list[tuple[Job, object]] = []

    def flush(self) -> None:
        if not self.items:
            return
        items, self.items = self.items, []
        by_loop: dict[int, list] = {}
        for job, event in items:
            by_loop.setdefault(id(job.loop), []).append((job, event))
        for group in by_loop.values():
            try:
                group[0][0].loop.call_soon_threadsafe(_put_all, group)
            except RuntimeError:  # a closed loop: its jobs' clients are gone
                for job, _ in group:
                    job.cancel.set()


def _put_all(group: list) -> None:
    for job, event in group:
        job.events.put_nowait(event)


class SlotQueue:
    """FIFO of jobs for the single slot; counts what runs and what waits (for /metrics)."""

    def __init__(self):
        self._q: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: set[int] = set()
        self.running = 0

    def submit(self, job: Job) -> None:
        with self._lock:
            self._waiting.add(id(job))
        self._q.put(job)

    def take(self, timeout: float) -> Job | None:
        try:
            job = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            self._waiting.discard(id(job))
        return job

    def forget(self, job: Job) -> None:
        """A queued job whose client left: no longer counted as waiting (the worker skips it)."""
        with self._lock:
            self._waiting.discard(id(job))

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)


def serve_jobs(slots: SlotQueue, run_job: Callable[[Job], None], stop: threading.Event,
               poll_s: float = 0.2) -> None:
    """The worker loop (the CLI's main thread, or a test's thread): run jobs in order until `stop` is set."""
    while not stop.is_set():
        job = slots.take(poll_s)
        if job is None:
            continue
        if job.cancel.is_set():  # the client left while it waited
            job.finished.set()
            continue
        slots.running = 1
        job.started.set()
        try:
            run_job(job)
        except Exception as exc:  # noqa: BLE001 - reported to the client; the slot goes on serving
            job.post(Failure(f"{type(exc).__name__}: {exc}"))
        finally:
            slots.running = 0
            job.finished.set()
