"""The router's pick-time bookkeeping in miniature, for scenario tests and benchmarks.

``PickLoop`` does per request what the live router does around a policy, in the
same order, against a real ``router.prefix_index.PrefixIndex``::

    match = index.match(hashes, now)              (counts the request: hot roots)
    views = one WorkerView per routable worker    (load as of pick time)
    d     = policy.choose(request, match, views, now)
    index.insert(d.worker, hashes, now)           (the optimistic hint)
    load[d.worker] += 1 request, uncached prompt tokens      (counted at pick time)
    for w in d.warm: a warm-up of hashes[:depth] queued on w (not counted as load)

Each worker is a FIFO prefill server at ``prefill_tokens_per_s``: a request's
prefill ends at ``max(now, busy_until) + uncached / rate``; ``advance(now)`` retires
the requests whose prefill has ended (their tokens leave ``in_flight_tokens``; the
request leaves ``in_flight`` ``decode_s`` later). No clocks: the caller passes ``now``.

Warm-ups are not hinted in the index — neither the live router nor the simulator
does (``router.warmup``): the warmed worker prefills the prefix like any request
(it occupies its FIFO) and, as its agent would report the blocks it stored, the
prefix enters the index for it when that prefill ends, not before.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.base import Decision, Policy, RouteRequest, WorkerView
from protocol.prefix_keys import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES, WorkerId
from router.prefix_index import PrefixIndex


@dataclass(slots=True)
class _Load:
    in_flight: int = 0
    in_flight_tokens: int = 0
    busy_until: float = 0.0
    prefill_tokens_per_s: float = 10_000.0


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
        self.load = {w: _Load(prefill_tokens_per_s=self.prefill_tokens_per_s) for w in self.workers}
        self._events: list[Any] = []  # (time, seq, kind, worker, tokens | warmed hashes)
        self._seq = 0
        self.decisions: list[Decision] = []
        self.warmups: list[tuple[str, int]] = []  # (worker, blocks) warm-ups sent

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
        """Routes one request at ``now`` and does the router's bookkeeping."""
        self.advance(now)
        match = self.index.match(hashes, now)
        req = RouteRequest(
            hashes, prompt_tokens, self.block_tokens, session, text_len=text_len or prompt_tokens * 4
        )
        d = self.policy.choose(req, match, views if views is not None else self.views(), now)
        if hashes:
            self.index.insert(d.worker, hashes, now)
        for w in d.warm:
            self.warmups.append((w, match.depth))
            if match.depth:
                self._warm(w, list(hashes[: match.depth]), now)
        l = self.load[d.worker]
        # the worker prefills what it does not hold; the router counts either that
        # or (count_cached) the whole prompt
        work = max(0, prompt_tokens - d.matched_blocks * self.block_tokens)
        tokens = prompt_tokens if self.count_cached else work
        l.in_flight += 1
        l.in_flight_tokens += tokens
        start = max(now, l.busy_until)
        l.busy_until = start + work / l.prefill_tokens_per_s
        self._push(l.busy_until, "prefill", d.worker, tokens)
        if self.check:
            self.index.check()
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
