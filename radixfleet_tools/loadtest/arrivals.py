"""Arrival processes and the driver that feeds a workload's sessions to a sender.

Three ways requests arrive, all bounded by a request count and a duration::

    Poisson(rate)        open loop: the k-th request is due at the k-th event of a
                         Poisson process (exponential gaps, seeded); with
                         ``burstiness`` b != 1 the gaps are gamma(b, 1/(rate*b)) as
                         in vllm bench serve (b < 1 burstier, b > 1 more regular,
                         the mean rate unchanged); ``max_concurrency`` caps the
                         requests in flight (arrivals wait beyond it)
    TraceTimes()         open loop: each request at its spec's ``arrival_s``
    Closed(concurrency)  closed loop: a new request as soon as one of C finishes

The driver keeps a *ready queue* of turns that may be sent now: the first turn of
every active session, and each next turn once the previous answer is back (a
session's turns never overlap). At most ``workload.max_active_sessions`` sessions
are in progress; when one ends, the next one starts. An open-loop arrival that
finds the ready queue empty waits for a turn to become ready (the client is
"typing"), so the offered rate is an upper bound for multi-turn workloads.

After the duration (or the count) no new request is dispatched; requests in flight
get ``drain_s`` to finish, then are cancelled (the sender records them as errors).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from radixfleet.wire.errors import WorkloadError
from radixfleet_tools.loadtest.workloads import RequestSpec, Session

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Poisson:
    """Open loop at ``rate`` requests/s (exponential inter-arrival gaps)."""

    rate: float
    #: gamma shape of the gaps: 1 Poisson (vLLM's --burstiness)
    burstiness: float = 1.0
    #: most requests in flight (None: ``Bounds.max_in_flight``)
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise WorkloadError(f"--rate must be > 0, got {self.rate}")
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise WorkloadError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise WorkloadError(f"--concurrency must be > 0, got {self.max_concurrency}")

    def gap(self, rng: random.Random) -> float:
        """Seconds to the next arrival (exactly ``expovariate`` at burstiness 1, so a
        seed gives the same arrivals as before burstiness existed)."""
        if self.burstiness == 1.0:
            return rng.expovariate(self.rate)
        return rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))


@dataclass(frozen=True, slots=True)
class TraceTimes:
    """Open loop at the specs' own ``arrival_s`` offsets (trace replay)."""


@dataclass(frozen=True, slots=True)
class Closed:
    """Closed loop: ``concurrency`` requests in flight."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency <= 0:
            raise WorkloadError(f"--concurrency must be > 0, got {self.concurrency}")


Arrivals = Poisson | TraceTimes | Closed


@dataclass(frozen=True, slots=True)
class Bounds:
    """A run stops at ``max_requests`` dispatched or ``duration_s`` elapsed, or when
    the workload is exhausted. None: no such bound (the command line's default, so a
    workload or trace runs whole unless the user bounds it)."""

    max_requests: int | None = 1000
    duration_s: float | None = 60.0
    #: grace for requests in flight at the end, then they are cancelled
    drain_s: float = 30.0
    #: open loop only: a safety cap on requests in flight (arrivals wait beyond it)
    max_in_flight: int = 1024

    def __post_init__(self) -> None:
        if self.max_requests is not None and self.max_requests <= 0:
            raise WorkloadError(f"--requests must be > 0, got {self.max_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError(f"--duration must be > 0, got {self.duration_s}")
        if self.drain_s < 0 or self.max_in_flight <= 0:
            raise WorkloadError("drain_s must be >= 0 and max_in_flight > 0")

    @property
    def request_cap(self) -> float:
        """``max_requests``, or infinity when unbounded."""
        return math.inf if self.max_requests is None else self.max_requests

    @property
    def duration_cap(self) -> float:
        """``duration_s``, or infinity when unbounded."""
        return math.inf if self.duration_s is None else self.duration_s

    def cut_note(self, stopped_by: str, dispatched: int, total: int | None) -> str | None:
        """What a run's report and table say when something other than the end of the
        workload stopped it (None when the workload ran whole). ``stopped_by`` is
        ``DriveStats.stopped_by``; ``total`` the workload's request count, if known."""
        of = f" of the workload's {total:,}" if total else ""
        if total and dispatched >= total:
            return None  # a bound reached with the last request cuts nothing
        if stopped_by == "requests":
            return f"cut by --requests {self.max_requests:,}: {dispatched:,}{of} requests sent"
        if stopped_by == "duration":
            return f"cut by --duration {self.duration_s:g} s: {dispatched:,}{of} requests sent"
        if stopped_by == "exhausted" and total and dispatched < total:
            return (
                f"{dispatched:,}{of} requests sent: a failed turn ends its session, "
                "so its later turns were never sent"
            )
        return None


class Pacer:
    """The arrival process's two decisions, made the same way by the live driver
    (``drive``) and the simulator's (``radixfleet_tools.loadtest.simulator.driver``), so that a
    workload, seed and arrival process give the same dispatch times in both:

    ``due(spec)``       when the next ready turn may leave: Poisson, the process's
                        next event; TraceTimes, ``start + spec.arrival_s``;
                        Closed, at once
    ``dispatched(now)`` after each dispatch: the next Poisson event is one gap
                        (``Poisson.gap``: exponential, or gamma with burstiness)
                        after the last, but never more than 1 s in the past (a
                        driver that fell behind does not burst to catch up)
    ``cap``             most requests in flight: Closed's concurrency, Poisson's
                        ``max_concurrency``, else ``Bounds.max_in_flight``

    The gaps come from one rng seeded with the workload's seed, drawn one per
    dispatch in dispatch order.
    """

    __slots__ = ("arrivals", "rng", "start", "next_due", "cap", "_kind")

    def __init__(self, arrivals: Arrivals, bounds: Bounds, *, seed: int, start: float) -> None:
        if not isinstance(arrivals, (Poisson, TraceTimes, Closed)):
            raise TypeError(f"arrivals must be Poisson, TraceTimes or Closed, got {arrivals!r}")
        self.arrivals = arrivals
        self.rng = random.Random(seed ^ 0x5EED)
        self.start = start
        self.next_due = start  # Poisson: when the next dispatch is due
        self._kind = next(k for k in (Poisson, TraceTimes, Closed) if isinstance(arrivals, k))
        if isinstance(arrivals, Closed):
            self.cap = arrivals.concurrency
        elif isinstance(arrivals, Poisson) and arrivals.max_concurrency is not None:
            self.cap = min(arrivals.max_concurrency, bounds.max_in_flight)
        else:
            self.cap = bounds.max_in_flight

    def due(self, spec: RequestSpec, now: float) -> float:
        """When ``spec`` (the first ready turn) may be dispatched."""
        kind = self._kind
        if kind is Poisson:
            return self.next_due
        if kind is TraceTimes:
            return self.start + (spec.arrival_s or 0.0)
        return now

    def dispatched(self, now: float) -> None:
        """A turn was dispatched at ``now``: the next Poisson event is drawn."""
        if self._kind is Poisson:
            # _kind is Poisson means arrivals is one: the class test stands in for
            # isinstance on this per-dispatch path, and mypy cannot narrow through it
            gap = self.arrivals.gap  # type: ignore[union-attr]
            self.next_due = max(self.next_due, now - 1.0) + gap(self.rng)


#: sends one spec; returns the answer text, or None if the request failed
Sender = Callable[[RequestSpec], Awaitable[str | None]]


@dataclass(slots=True)
class DriveStats:
    dispatched: int = 0
    completed: int = 0  # answered (successfully or not) before the end
    cancelled: int = 0  # still in flight when the drain grace ran out
    sessions_started: int = 0
    sessions_finished: int = 0
    #: why dispatching stopped: 'requests', 'duration' or 'exhausted'
    stopped_by: str = ""
    elapsed_s: float = 0.0


async def drive(
    sessions: Sequence[Session],
    arrivals: Arrivals,
    bounds: Bounds,
    send: Sender,
    *,
    max_active_sessions: int | None = None,
    seed: int = 0,
    on_dispatch: Callable[[RequestSpec], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> DriveStats:
    """Runs the sessions through ``send`` under ``arrivals`` within ``bounds``.

    ``on_dispatch(spec)`` is called synchronously just before each send, in
    dispatch order (the report's oracle and pooled caches see that order).
    Never raises for a failed request; cancels whatever is still running on exit.
    """
    stats = DriveStats()
    pending = iter(sessions)
    active_limit = max_active_sessions or len(sessions) or 1
    ready: collections.deque[tuple[Session, RequestSpec]] = collections.deque()
    active = 0
    in_flight: set[asyncio.Task] = set()
    changed = asyncio.Event()  # set whenever a turn becomes ready or a request ends
    start = clock()
    pacer = Pacer(arrivals, bounds, seed=seed, start=start)
    deadline = start + bounds.duration_cap
    max_requests = bounds.request_cap

    def activate() -> None:
        nonlocal active
        while active < active_limit:
            s = next(pending, None)
            if s is None:
                return
            active += 1
            stats.sessions_started += 1
            ready.append((s, s.first()))

    def finish_session() -> None:
        nonlocal active
        active -= 1
        stats.sessions_finished += 1
        activate()

    async def run_one(session: Session, spec: RequestSpec) -> None:
        answer = None
        try:
            answer = await send(spec)
        except Exception:  # a sender bug must not stop the run; it is a failed request
            log.exception("sender failed on %s", spec.id)
        finally:
            nxt = session.follow(answer) if answer is not None else None
            if nxt is None:
                finish_session()  # done, or failed: a conversation cannot go on without its answer
            else:
                ready.append((session, nxt))
            # out of in_flight before the wake-up: the done callback runs after the
            # dispatcher resumes, which would then wait for a change that never comes
            # (with no duration bound, forever)
            in_flight.discard(asyncio.current_task())
            changed.set()

    def exhausted() -> bool:
        return not ready and not in_flight

    async def wait_change(until: float | None) -> None:
        changed.clear()
        timeout = None if until is None or until == math.inf else max(0.0, until - clock())
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    activate()
    cap = pacer.cap
    try:
        while True:
            if stats.dispatched >= max_requests:
                stats.stopped_by = "requests"
                break
            now = clock()
            if now >= deadline:
                stats.stopped_by = "duration"
                break
            if exhausted():
                stats.stopped_by = "exhausted"
                break
            if not ready or len(in_flight) >= cap:
                await wait_change(deadline)
                continue
            session, spec = ready[0]
            due = pacer.due(spec, now)
            if due > now:
                # sleep until due, but wake early if the deadline comes first
                await asyncio.sleep(min(due, deadline) - now)
                continue
            ready.popleft()
            pacer.dispatched(now)
            stats.dispatched += 1
            if on_dispatch is not None:
                on_dispatch(spec)
            task = asyncio.create_task(run_one(session, spec))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            done, not_done = await asyncio.wait(set(in_flight), timeout=bounds.drain_s)
            for t in not_done:
                t.cancel()
            stats.cancelled = len(not_done)
            if not_done:
                await asyncio.gather(*not_done, return_exceptions=True)
    finally:
        for t in list(in_flight):
            t.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        stats.elapsed_s = clock() - start
        stats.completed = stats.dispatched - stats.cancelled
    return stats
