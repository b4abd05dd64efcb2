"""The route core on a fleet of FIFO prefill servers, for scenario tests and benchmarks.

``PickLoop`` routes each request through the router's own route core
(``radixfleet.route.core.RouteCore.decide``) against a real ``radixfleet.index.prefix_index.PrefixIndex``
and keeps the fleet's load itself, in virtual time::

    advance(now)                                  prefills (and decodes) ended by now retire
    RouteCore.decide(Ask(keyer), now)             views (one per worker, load as of pick
                                                  time), key (one byte space) and match
                                                  (hot roots counted), the policy's choice
    for w in d.warm: a warm-up of hashes[:depth]  queued on w's FIFO (not counted as
                                                  load), as the data plane sends them
    RouteCore.place(worker, keyed, now)           the hint (index.insert) and the load
                                                  count (``_Fleet.pick``: uncached tokens),
                                                  the request queued behind the warm-ups

The fleet (``_Fleet``) stands where the router's ``Pool`` does for the core: each
worker is a FIFO prefill server at ``prefill_tokens_per_s``; a request's prefill ends
at ``max(now, busy_until) + uncached / rate``; ``advance(now)`` retires the requests
whose prefill has ended (their tokens leave ``in_flight_tokens``; the request leaves
``in_flight`` ``decode_s`` later). No clocks: the caller passes ``now``. There is no
admission chain (no shedder, no tenancy): every request is routed.

Warm-ups are not hinted in the index (neither the live router nor the simulator
does: ``radixfleet.route.warmup``): the warmed worker prefills the prefix like any request (it
occupies its FIFO) and, as its agent would report the blocks it stored, the prefix
enters the index for it when that prefill ends, not before.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES, WorkerId
from radixfleet.policies.base import Decision, Policy, RouteRequest, WorkerView
from radixfleet.route.core import Ask, Reject, Route, RouteCore, RouteParts
from radixfleet.wire.errors import NoWorkerAvailable

#: the harness's one key space (routing bytes at its block size)
_SPACE = "bytes"


@dataclass(slots=True)
class _Load:
    """One worker's load as the route core counts it (``_Fleet.pick``) and its FIFO."""

    id: str = ""
    in_flight: int = 0
    in_flight_tokens: int = 0
    busy_until: float = 0.0
    prefill_tokens_per_s: float = 10_000.0
    #: no engine link: the route core keeps no ranks or match counts for it
    engine: None = None


class _Fleet:
    """The harness's workers where the route core expects the router's pool: ``get``,
    ``pick`` (the load count at pick time, and the request's place in the FIFO) and
    ``unavailable``. Only ``PickLoop`` and the core it built call it."""

    __slots__ = ("load", "loop")

    def __init__(self, loop: PickLoop, load: dict[str, _Load]) -> None:
        self.loop = loop
        self.load = load

    def get(self, worker: str) -> _Load | None:
        return self.load.get(worker)

    def pick(self, w: _Load, uncached: int, prompt_tokens: int = 0) -> None:
        """Counts the request on ``w``: its uncached prompt tokens (or, with
        ``count_cached``, the whole prompt) until its prefill ends in ``w``'s FIFO."""
        loop = self.loop
        tokens = prompt_tokens if loop.count_cached else uncached
        w.in_flight += 1
        w.in_flight_tokens += tokens
        w.busy_until = max(loop.now, w.busy_until) + uncached / w.prefill_tokens_per_s
        loop._push(w.busy_until, "prefill", w.id, tokens)

    def unavailable(self, model: str, adapter: str | None, now: float) -> NoWorkerAvailable:
        return NoWorkerAvailable("the harness has no workers", retry_after_s=1)


@dataclass
class PickLoop:
    policy: Policy
    workers: Sequence[str]
    index: PrefixIndex = field(default_factory=PrefixIndex)
    block_tokens: int = DEFAULT_BLOCK_BYTES // BYTES_PER_TOKEN
    prefill_tokens_per_s: float = 10_000.0
    #: seconds a request stays in flight after its prefill (decode), 0 = leaves at once
    decode_s: float = 0.0
    #: count full prompt tokens as in-flight work instead of the uncached part
    count_cached: bool = False
    #: check the index invariants after every mutation (tests)
    check: bool = False

    def __post_init__(self) -> None:
        self.load = {w: _Load(w, prefill_tokens_per_s=self.prefill_tokens_per_s) for w in self.workers}
        self._events: list[Any] = []  # (time, seq, kind, worker, tokens | warmed hashes)
        self._seq = 0
        self.now = 0.0  # the time of the request being routed
        self.decisions: list[Decision] = []
        self.warmups: list[tuple[str, int]] = []  # (worker, blocks) warm-ups sent
        self._given: list[WorkerView] | None = None  # ``route(views=...)`` for one call
        #: the route core over this fleet (it stands where the router's Pool does)
        fleet: Any = _Fleet(self, self.load)
        self.core = RouteCore(RouteParts(fleet, self.index, self.policy, views=self._views))

    def views(self) -> list[WorkerView]:
        return [
            WorkerView(
                WorkerId(w),
                in_flight=l.in_flight,
                in_flight_tokens=l.in_flight_tokens,
                prefill_tokens_per_s=l.prefill_tokens_per_s,
            )
            for w, l in self.load.items()
        ]

    def _views(self, now: float, model: str, adapter: str | None) -> list[WorkerView]:
        return self._given if self._given is not None else self.views()

    def _warm(self, w: str, prefix: list[Any], now: float) -> None:
        """A warm-up of ``prefix`` on ``w``: prefilled in its FIFO (not counted as
        load); its blocks enter the index when that prefill ends (the agent's report)."""
        l = self.load[w]
        work = len(prefix) * self.block_tokens
        l.busy_until = max(now, l.busy_until) + work / l.prefill_tokens_per_s
        self._push(l.busy_until, "warmed", w, prefix)

    def advance(self, now: float) -> None:
        """Retires prefills (and decodes) that have ended by ``now``."""
        ev = self._events
        while ev and ev[0][0] <= now:
            t, _, kind, w, tokens = heapq.heappop(ev)
            l = self.load[w]
            if kind == "warmed":  # tokens: the warmed prefix's hashes
                self.index.insert(w, tokens, t)
                continue
            if kind == "prefill":
                l.in_flight_tokens -= tokens
                if self.decode_s > 0:
                    self._push(t + self.decode_s, "done", w, 0)
                else:
                    l.in_flight -= 1
            else:
                l.in_flight -= 1

    def _push(self, t: float, kind: str, w: str, tokens: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, w, tokens))

    def route(
        self,
        hashes: Sequence[int],
        prompt_tokens: int,
        now: float,
        *,
        session: str | None = None,
        text_len: int = 0,
        views: list[WorkerView] | None = None,
    ) -> Decision:
        """Routes one request at ``now`` through the route core (module docstring);
        ``views``: the candidates instead of every worker's own view."""
        self.advance(now)
        self.now = now
        index = self.index
        req = RouteRequest(
            hashes, prompt_tokens, self.block_tokens, session, text_len=text_len or prompt_tokens * 4
        )
        key = SpaceKey(hashes, prompt_tokens, self.block_tokens, False)

        def keyer(views: Sequence[WorkerView], now: float) -> KeyedRequest:
            return KeyedRequest.single(_SPACE, key, req, index.match(hashes, now))

        self._given = views
        try:
            verdict = self.core.decide(Ask(keyer, "", place=False), now)
        finally:
            self._given = None
        if isinstance(verdict, Reject):
            raise verdict.error
        assert isinstance(verdict, Route), "no admission chain, no P/D split: routed"
        d = verdict.decision
        depth = verdict.keyed.match.depth
        # the warm-ups take their place in the FIFOs ahead of the request's prefill
        for w in d.warm:
            self.warmups.append((w, depth))
            if depth:
                self._warm(w, list(hashes[:depth]), now)
        self.core.place(verdict.worker, verdict.keyed, now)
        if self.check:
            index.check()
            chk = getattr(self.policy, "check", None)
            if chk is not None:
                chk()
        self.decisions.append(d)
        return d

    def chosen(self) -> list[str]:
        return [d.worker for d in self.decisions]


def counts(workers: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in workers:
        out[w] = out.get(w, 0) + 1
    return out
