"""The load generator's session driver (``radixfleet_tools.loadtest.arrivals.drive``) in virtual time.

Same rules as the live driver, same order of decisions, no asyncio::

    ready queue   the first turn of every active session, and each next turn once
                  the previous answer is back (a session's turns never overlap)
    active        at most ``max_active_sessions`` sessions in progress
    arrivals      when a turn is due and how many may be in flight: the live
                  driver's ``radixfleet_tools.loadtest.arrivals.Pacer`` itself (Poisson with its
                  burstiness and concurrency cap, TraceTimes, Closed; the same
                  seeded gaps), so a seed gives the same dispatches here and live
    Bounds        stop dispatching at ``max_requests`` or ``duration_s``; requests
                  in flight get ``drain_s`` more, then are cancelled

The simulation owns the clock. It calls ``pump(now)`` whenever something may have
changed (a completion, or the wake-up time the last ``pump`` asked for); ``pump``
dispatches every turn that is due at ``now`` through ``dispatch(session, spec)``
and returns the next time it wants to be woken without a completion (``None``:
only a completion can unblock it). ``complete(session, answer)`` records that a
request ended (``answer`` None: it failed, so its session ends).

Invariants (``check()``): ``in_flight == dispatched - completed``; ``0 <= active
<= limit``; every ready turn belongs to an active session with no request in
flight.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

from radixfleet_tools.loadtest.arrivals import Bounds, Pacer
from radixfleet_tools.loadtest.workloads import RequestSpec, Session

#: dispatch(session, spec) -> None; called in dispatch order
Dispatch = Callable[[Session, RequestSpec], None]


class VirtualDriver:
    """Feeds a workload's sessions to the simulated router on a virtual clock."""

    __slots__ = (
        "pacer",
        "bounds",
        "dispatch",
        "pending",
        "limit",
        "ready",
        "active",
        "in_flight",
        "dispatched",
        "completed",
        "sessions_started",
        "sessions_finished",
        "start",
        "deadline",
        "stopped_at",
        "stopped_by",
    )

    def __init__(
        self,
        sessions: Sequence[Session],
        arrivals,
        bounds: Bounds,
        dispatch: Dispatch,
        *,
        max_active_sessions: int | None = None,
        seed: int = 0,
        start: float = 0.0,
    ) -> None:
        # the live driver's pacing: the same due times, gaps (same seeded rng) and cap
        self.pacer = Pacer(arrivals, bounds, seed=seed, start=start)
        self.bounds = bounds
        self.dispatch = dispatch
        self.pending = iter(sessions)
        self.limit = max_active_sessions or len(sessions) or 1
        self.ready: collections.deque[tuple[Session, RequestSpec]] = collections.deque()
        self.active = 0  # sessions started and not finished (only this class changes it)
        self.in_flight = 0  # dispatched, not completed
        self.dispatched = 0
        self.completed = 0
        self.sessions_started = 0
        self.sessions_finished = 0
        self.start = start
        self.deadline = start + bounds.duration_cap  # inf: no duration bound
        #: when dispatching stopped (None: still dispatching) and why
        self.stopped_at: float | None = None
        self.stopped_by = ""
        self._activate()

    # ----------------------------------------------------------------- sessions

    def _activate(self) -> None:
        while self.active < self.limit:
            s = next(self.pending, None)
            if s is None:
                return
            self.active += 1
            self.sessions_started += 1
            self.ready.append((s, s.first()))

    def _finish_session(self) -> None:
        self.active -= 1
        self.sessions_finished += 1
        if self.stopped_at is None:
            self._activate()

    def complete(self, session: Session, answer: str | None) -> None:
        """A request of ``session`` ended; ``answer`` None means it failed."""
        self.in_flight -= 1
        self.completed += 1
        nxt = session.follow(answer) if answer is not None else None
        if nxt is None:
            self._finish_session()
        else:
            self.ready.append((session, nxt))

    # ----------------------------------------------------------------- dispatch

    @property
    def done(self) -> bool:
        """Dispatching has stopped and nothing is in flight."""
        return self.stopped_at is not None and self.in_flight == 0

    def _stop(self, now: float, why: str) -> None:
        self.stopped_at = now
        self.stopped_by = why

    def pump(self, now: float) -> float | None:
        """Dispatches every turn due at ``now``; returns the next wake-up time."""
        if self.stopped_at is not None:
            return None
        pacer = self.pacer
        cap = pacer.cap
        max_requests = self.bounds.request_cap
        ready = self.ready
        while True:
            if self.dispatched >= max_requests:
                self._stop(now, "requests")
                return None
            if now >= self.deadline:
                self._stop(now, "duration")
                return None
            if not ready and self.in_flight == 0:
                self._stop(now, "exhausted")
                return None
            if not ready or self.in_flight >= cap:
                # a completion (or the deadline) unblocks us; no deadline: only a completion
                return self.deadline if self.deadline != math.inf else None
            session, spec = ready[0]
            due = pacer.due(spec, now)
            if due > now:
                return min(due, self.deadline)
            ready.popleft()
            pacer.dispatched(now)
            self.dispatched += 1
            self.in_flight += 1
            self.dispatch(session, spec)

    def check(self) -> None:
        """Asserts the invariants in the module docstring."""
        assert self.in_flight == self.dispatched - self.completed, (
            f"{self.in_flight=} {self.dispatched=} {self.completed=}"
        )
        assert 0 <= self.active <= self.limit, f"{self.active=} {self.limit=}"
        ids = [id(s) for s, _ in self.ready]
        assert len(ids) == len(set(ids)), "a session has two ready turns"
        assert self.sessions_started - self.sessions_finished == self.active, (
            f"{self.sessions_started=} {self.sessions_finished=} {self.active=}"
        )
