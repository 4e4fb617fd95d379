"""Waves of requests: a client whose reply ends usually sends its next request within milliseconds (a load
generator, an agent's next call, a script's loop), so the replies of several streams that end together bring back a
wave of prompts. Admitted one by one as they come, such a wave costs a step of the first prompt alone, then a step of
the rest beside its first decode, and the streams stay out of step from then on (each wave's first request ends a
step or two before the others, and comes back alone again). The batched worker gathers arrivals instead while more
are expected soon: one for each reply that ended within RETURN_WINDOW_S whose client has not come back, and one for
each running sequence within NEAR_END tokens of its max_tokens. What it gathered is admitted once it fills the slots
free by then, once its prompts fill a step's token budget (-b: later arrivals could not join that step anyway), once
no arrival is expected, or MAX_WAIT_S after the first arrival, whichever comes first. A lone client (each request
after the last reply) is never held: its return was expected and came."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

RETURN_WINDOW_S = 0.1  # a reply's client counts as coming back for this long after it ended
NEAR_END = 2  # a running sequence this many tokens from its max_tokens or fewer counts as a reply about to end
MAX_WAIT_S = 0.02  # the longest an arrival is held for the rest of its wave


class Arrivals:
    """Requests taken from the queue and held for the rest of their wave (see the module's text)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = RETURN_WINDOW_S,
                 max_wait_s: float = MAX_WAIT_S):
        self.clock = clock
        self.window_s = window_s
        self.max_wait_s = max_wait_s
        self.ended: deque[float] = deque()  # when replies ended whose clients have not come back yet
        self.gathered: list = []
        self.tokens: list[int] = []  # each gathered request's prompt tokens
        self.since = 0.0  # when the first of `gathered` came

    def reply_ended(self) -> None:
        self.ended.append(self.clock())

    def gather(self, job, tokens: int = 0) -> None:
        """A request (of `tokens` prompt tokens) taken from the queue: held until release(); it is the return of the
        oldest ended reply."""
        now = self._expire()
        if self.ended:
            self.ended.popleft()
        if not self.gathered:
            self.since = now
        self.gathered.append(job)
        self.tokens.append(tokens)

    def wait_s(self, free: int, near_end: int, budget: int = 0) -> float:
        """Seconds to go on gathering (0: admit what is gathered now). free: slots free now; near_end: running
        sequences within NEAR_END tokens of their end; budget: a step's prompt tokens (-b; 0: no bound)."""
        if not self.gathered:
            return 0.0
        now = self._expire()
        if not self.ended and not near_end:  # nothing more expected
            return 0.0
        if len(self.gathered) >= free + near_end:  # the wave fills what will be free
            return 0.0
        if budget and sum(self.tokens) >= budget:  # the wave fills a step
            return 0.0
        return max(0.0, self.since + self.max_wait_s - now)

    def release(self, n: int) -> list:
        """The first n gathered requests, to admit (the rest stay gathered, their wait going on)."""
        jobs, self.gathered, self.tokens = self.gathered[:n], self.gathered[n:], self.tokens[n:]
        return jobs

    def _expire(self) -> float:
        now = self.clock()
        while self.ended and now - self.ended[0] > self.window_s:
            self.ended.popleft()
        return now


def near_end(seq) -> bool:
    """A decoding sequence within NEAR_END tokens of its max_tokens (scheduler.Seq)."""
    n = seq.req.n_predict
    return not seq.remaining and n > 0 and n - len(seq.produced) <= NEAR_END
