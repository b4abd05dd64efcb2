"""The load generator's session driver (``loadtest.arrivals.drive``) in virtual time.

Same rules as the live driver, same order of decisions, no asyncio::

    ready queue   the first turn of every active session, and each next turn once
                  the previous answer is back (a session's turns never overlap)
    active        at most ``max_active_sessions`` sessions in progress
    Poisson(r)    the k-th dispatch is due at ``next_due``; after it,
                  ``next_due = max(next_due, now - 1) + Exp(r)`` (same seeded rng)
    TraceTimes    each turn at ``start + spec.arrival_s``
    Closed(c)     a new request as soon as fewer than c are in flight
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
import random
from collections.abc import Callable, Sequence

from loadtest.arrivals import Bounds, Closed, Poisson, TraceTimes
from loadtest.workloads import RequestSpec, Session

#: dispatch(session, spec) -> None; called in dispatch order
Dispatch = Callable[[Session, RequestSpec], None]


class VirtualDriver:
    """Feeds a workload's sessions to the simulated router on a virtual clock."""

    __slots__ = (
        "arrivals",
        "bounds",
        "dispatch",
        "rng",
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
        "next_due",
        "stopped_at",
        "stopped_by",
        "cap",
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
        if not isinstance(arrivals, (Poisson, TraceTimes, Closed)):
            raise TypeError(f"arrivals must be Poisson, TraceTimes or Closed, got {arrivals!r}")
        self.arrivals = arrivals
        self.bounds = bounds
        self.dispatch = dispatch
        # the live driver's rng, so Poisson gaps are the same numbers
        self.rng = random.Random(seed ^ 0x5EED)
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
        self.next_due = start
        #: when dispatching stopped (None: still dispatching) and why
        self.stopped_at: float | None = None
        self.stopped_by = ""
        self.cap = arrivals.concurrency if isinstance(arrivals, Closed) else bounds.max_in_flight
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
        arrivals = self.arrivals
        poisson = arrivals.__class__ is Poisson
        trace = arrivals.__class__ is TraceTimes
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
            if not ready or self.in_flight >= self.cap:
                # a completion (or the deadline) unblocks us; no deadline: only a completion
                return self.deadline if self.deadline != math.inf else None
            session, spec = ready[0]
            if trace:
                due = self.start + (spec.arrival_s or 0.0)
            elif poisson:
                due = self.next_due
            else:
                due = now
            if due > now:
                return min(due, self.deadline)
            ready.popleft()
            if poisson:
                self.next_due = max(self.next_due, now - 1.0) + self.rng.expovariate(arrivals.rate)
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
