"""The fair-share admission queue: at saturation, a request the shedder would refuse
waits at the router, briefly and boundedly, and the waiting requests are let in by
priority class, then by weighted fair queuing across tenants on tokens.

Per data-plane request, after its ticket (``radixfleet.route.tenancy``)::

    admit(waiter, probe)       probe(now): the shedder's verdict for this request
        queue off (tenancy.queue.max_wait_s 0)      -> probe(now): 429 or admitted
        nobody waiting and probe admits             -> admitted (the fast path)
        queue full (tenancy.queue.max_length)       -> the probe's 429 at once
        else it waits; ``release`` lets the head in while its probe admits:
            head = the highest class with waiters, then in it the tenant with the
                   smallest virtual token counter, then that tenant's oldest request
        past max_wait_s                             -> the 429 + Retry-After its
                                                       last probe gave (shed as before)
        the client gone (the task cancelled)        -> it leaves the queue

``release`` lets one request in at a time (the next once the last is counted on its
worker) and runs whenever a worker may have room: a request's first token or its end
(``kick``, from where the data plane calls ``pool.prefilled`` / ``pool.finish``), a
new arrival, and a backstop timer every ``TICK_S`` while anyone waits (load reports
arrive on their own schedule). While anyone waits a new arrival queues behind the
waiters it ranks after, rather than being checked first: the queue's order is the
order of admission.

Why a queue and not only shedding: the shedder admits work until each worker's queue
reaches a bound; an engine serves its queue first-in first-out, so a critical request
arriving at a saturated fleet waits behind whatever standard and sheddable work was
admitted before it. Here lower classes wait at the router, where a critical arrival
overtakes them.

Why virtual token counters (VTC, Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024) rather than deficit round robin: a request's cost is known at
admission (its prompt plus its output bound, the reservation the rate limits take:
``Ticket.reserved``, radixfleet.route.tenancy.output_bound) and the queue releases one request
at a time when the shedder says a worker has room, not in rounds of a quantum; VTC
serves the backlogged tenant that has been served least, weighted, which is exactly
"a tenant over its share waits before one under it", with O(tenants waiting) per
release and no quantum to tune. A tenant's counter advances by ``cost / weight``
when one of its requests is let in; a tenant that starts waiting has its counter
lifted to the smallest counter of the tenants already waiting (idle time banks no
credit: it cannot then starve the others), and when the queue empties every counter
is forgotten (fairness is between tenants competing for the same saturation). Decode
counts through the output bound (``max_completion_tokens``, ``max_tokens``,
``sampling_params.max_new_tokens``, as the endpoint's engines read them): a request
that gives none counts its prompt only.

Why off by default (``max_wait_s: 0``): queueing changes the answer a saturated
router gives, from an immediate 429 a client can retry elsewhere to a wait of up to
``max_wait_s``; deployments and clients built on "shed only at saturation, at once"
keep that until they opt in. Turned on, a request never waits longer than
``max_wait_s`` and then gets the same 429 it would have got, so a client's worst case
is the 429 ``max_wait_s`` later.

Invariants (``check()``): the bands hold exactly the waiters counted, each once, none
resolved; every tenant with waiters has a counter and its count of waiters; the timer
is armed exactly while anyone waits.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import Field

from radixfleet.wire.errors import ConfigError, Overloaded
from radixfleet.wire.settings import document_check, setting, settings

#: seconds between the backstop's releases while anyone waits
TICK_S = 0.02
#: the classes, highest first (radixfleet.route.tenancy.PRIORITIES: rank = index)
CLASSES = ("critical", "standard", "sheddable")

#: a tenant's weight in the fair share
Weight = Annotated[float, Field(gt=0, le=1e6, strict=True)]


@settings
class AdmissionQueueConfig:
    max_wait_s: float = setting(
        0.0,
        "at saturation, seconds a request the shedder refuses waits at the router for room "
        "(then the same 429); 0: off, shed at once",
        lo=0,
        hi=600,
    )
    max_length: int = setting(
        1000, "requests waiting at most; past it a request is shed at once", lo=1, hi=1_000_000
    )
    weights: Mapping[str, Weight] = Field(
        default_factory=dict,
        description=(
            "tenant -> its weight in the fair share: the queue's order, fair_share's and its part "
            "of the prefetch budget (others: 1)"
        ),
    )

    @document_check
    def _check(self) -> None:
        for t in self.weights:
            if not t:
                raise ConfigError("weights", "a tenant name must not be empty")


#: the shedder's verdict for one request at a time: None admits, else the 429
Probe = Callable[[float], Overloaded | None]


class Waiter:
    """One request waiting (``AdmissionQueue.admit``)."""

    __slots__ = ("tenant", "rank", "cost", "probe", "since", "deadline", "future", "refusal", "queued")

    def __init__(self, tenant: str, rank: int, cost: int, probe: Probe) -> None:
        self.tenant = tenant
        self.rank = rank  # its class's index in CLASSES
        self.cost = cost  # tokens: prompt + output bound (Ticket.reserved)
        self.probe = probe
        self.since = 0.0
        self.deadline = 0.0
        self.future: asyncio.Future | None = None
        self.refusal: Overloaded | None = None  # its last probe's 429
        self.queued = False  # in a band (only the queue changes it)


class AdmissionQueue:
    """Waiting requests by class and tenant. One event loop owns it; ``admit`` is O(1)
    when nobody waits, a release O(tenants waiting).

    ``metrics``: a ``radixfleet.server.metrics.Metrics`` (``admission_queued``,
    ``admission_wait``)."""

    def __init__(self, cfg: AdmissionQueueConfig, metrics: Any) -> None:
        self.cfg = cfg
        self.metrics = metrics
        #: per class, tenant -> its waiters, oldest first (no empty deque)
        self._bands: list[dict[str, collections.deque[Waiter]]] = [{} for _ in CLASSES]
        self._count: dict[str, int] = {}  # tenant -> its waiters, all classes
        self._vtc: dict[str, float] = {}  # tenant -> its virtual token counter
        self._arrivals: collections.deque[Waiter] = collections.deque()  # for expiry (lazy)
        self._n = 0
        self._timer: asyncio.TimerHandle | None = None
        self._again = False  # a release is scheduled behind the last one let in
        self._refusal: Overloaded | None = None  # the latest 429 a probe gave
        self._gauges = [metrics.admission_queued.labels(c) for c in CLASSES]

    def configure(self, cfg: AdmissionQueueConfig) -> None:
        """A reload: waiters keep their deadlines."""
        self.cfg = cfg

    @property
    def waiting(self) -> int:
        return self._n

    async def admit(
        self, tenant: str, rank: int, cost: int, probe: Probe, now: float
    ) -> tuple[Overloaded | None, bool]:
        """(None once the request may go to a worker, else the 429 to answer with;
        whether it waited in the queue). A cancellation (the client gone) takes the
        request out of the queue."""
        cfg = self.cfg
        if not self._n or cfg.max_wait_s <= 0:
            refusal = probe(now)
            if refusal is None or cfg.max_wait_s <= 0 or self._n >= cfg.max_length:
                return refusal, False
        elif self._n >= cfg.max_length:
            return probe(now), False
        else:
            refusal = None
        w = Waiter(tenant, rank, cost, probe)
        if refusal is not None:
            w.refusal = self._refusal = refusal
        w.since, w.deadline = now, now + cfg.max_wait_s
        w.future = asyncio.get_running_loop().create_future()
        self._join(w)
        if refusal is None:  # queued behind others: the order decides
            self._release(now)
        if w.future.done():
            return w.future.result(), True
        try:
            return await w.future, True
        except asyncio.CancelledError:
            if w.queued:
                self._leave(w, "left", time.monotonic())
            raise

    def kick(self, now: float) -> None:
        """A worker may have room (a first token, a finish): lets waiters in."""
        if self._n:
            self._release(now)

    def _release(self, now: float) -> bool:
        """Lets the head in if its probe admits, and the next once that one is
        counted on its worker; expires waiters past their deadline. Whether anyone
        was let in.

        One at a time: a request let in is picked (its load counted on the worker)
        only when its task runs, so probing the next head at once would see the
        room it is about to take. The next release is scheduled behind its wake-up
        (``call_soon`` after ``set_result``: the task picks without awaiting)."""
        let_in = False
        if self._n:
            w = self._head()
            refusal = w.probe(now)
            if refusal is None:
                self._vtc[w.tenant] += w.cost / self.cfg.weights.get(w.tenant, 1.0)
                self._leave(w, "admitted", now)
                assert w.future is not None  # set when it joined (queued)
                w.future.set_result(None)
                let_in = True
                if self._n and not self._again:
                    self._again = True
                    asyncio.get_running_loop().call_soon(self._next)
            else:
                w.refusal = self._refusal = refusal
        arrivals = self._arrivals
        while arrivals and (not arrivals[0].queued or arrivals[0].deadline <= now):
            w = arrivals.popleft()
            if w.queued:
                self._expire(w, now)
        return let_in

    def _expire(self, w: Waiter, now: float) -> None:
        """``w`` waited ``max_wait_s``: its 429. One never checked (it waited behind
        others all along) gets the fleet's latest 429, the head's; it is not checked
        now, which could let in more than the room (``_release``)."""
        refusal = w.refusal or self._refusal
        if refusal is None:  # not reached: a waiter joins only behind a refused head
            refusal = Overloaded(f"the fleet stayed saturated for {self.cfg.max_wait_s:g}s; retry later")
        self._leave(w, "expired", now)
        assert w.future is not None  # set when it joined (queued)
        w.future.set_result(refusal)

    def _head(self) -> Waiter:
        for band in self._bands:
            if band:
                vtc = self._vtc
                tenant = min(band, key=vtc.__getitem__)
                return band[tenant][0]
        raise AssertionError("no waiter")

    def _join(self, w: Waiter) -> None:
        t = w.tenant
        if not self._count.get(t):  # starts waiting: no credit banked while idle
            floor = min((self._vtc[u] for u in self._count), default=None)
            v = self._vtc.get(t, 0.0)
            self._vtc[t] = v if floor is None or v >= floor else floor
        self._count[t] = self._count.get(t, 0) + 1
        band = self._bands[w.rank]
        q = band.get(t)
        if q is None:
            q = band[t] = collections.deque()
        q.append(w)
        w.queued = True
        self._arrivals.append(w)
        self._n += 1
        self._gauges[w.rank].inc()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def _leave(self, w: Waiter, outcome: str, now: float) -> None:
        t = w.tenant
        band = self._bands[w.rank]
        q = band[t]
        if q[0] is w:
            q.popleft()
        else:
            q.remove(w)
        if not q:
            del band[t]
        w.queued = False
        self._n -= 1
        self._gauges[w.rank].dec()
        self.metrics.admission_wait.labels(CLASSES[w.rank], outcome).observe(now - w.since)
        left = self._count[t] - 1
        if left:
            self._count[t] = left
        else:
            del self._count[t]
        if not self._n:  # nobody competes: counters are forgotten
            self._vtc.clear()
            self._refusal = None
            self._arrivals.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        elif not left:  # a tenant gone idle at or below the floor needs no counter
            floor = min(self._vtc[u] for u in self._count)
            if self._vtc[t] <= floor:
                del self._vtc[t]

    def _next(self) -> None:
        self._again = False
        if self._n:
            self._release(time.monotonic())

    def _tick(self) -> None:
        self._timer = None
        if self._n:
            self._release(time.monotonic())
        if self._n and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def check(self) -> None:
        n = 0
        per: dict[str, int] = {}
        for rank, band in enumerate(self._bands):
            for t, q in band.items():
                assert q, ("empty deque", t)
                for w in q:
                    assert w.queued and w.rank == rank and w.tenant == t, (w.tenant, w.rank)
                    assert w.future is not None and not w.future.done(), t
                    n += 1
                    per[t] = per.get(t, 0) + 1
        assert n == self._n, (n, self._n)
        assert per == self._count, (per, self._count)
        assert all(t in self._vtc for t in per), (per, self._vtc)
        assert (self._timer is not None) == (n > 0), (self._timer, n)
        assert not n or sum(w.queued for w in self._arrivals) == n, n
