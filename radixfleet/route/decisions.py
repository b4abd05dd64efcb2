"""Why each request went where it went: routing quality and the recent decisions.

**Routing quality** (``Quality``), three numbers per answered request, in tokens::

    available   the best match among the decision's eligible workers (the reuse
                that was there anywhere in the fleet, as the index saw it at pick
                time; ``Route.available_tokens``), at least ``predicted``
    predicted   the chosen worker's match in its own key space (what the route
                core counted: ``Placement.blocks``)
    delivered   the cached prompt tokens the worker's answer reported (usage
                ``cached_tokens``; None: it reported none)

With the prompt P they split what was not reused: ``P - available`` is the
*capacity loss* (the prefix was nowhere: the fleet's caches are too small, or it
is new), ``available - predicted`` the *routing loss* (it was elsewhere: load,
churn or a bound sent the request away from it), ``predicted - delivered`` the
*prediction gap* (the index believed more than the engine had; negative when the
engine had more). Where the worker reported its prompt tokens, ``available`` and
``predicted`` are capped at that count, so every share stays within the prompt.
The router counts them per worker and model (``radixfleet_available_cached_tokens
_total``, ``radixfleet_predicted_cached_tokens_total`` beside ``radixfleet_cached_
tokens_total``: radixfleet.server.metrics), writes them in the traffic log (``available_tokens``,
``matched_tokens``, ``cached_tokens``), and ``radixfleet analyze`` reports the losses.

**Recent decisions** (``DecisionRing``, ``GET /admin/decisions?n=``): the last
``decisions.size`` client requests' last decisions, each with its candidates'
figures (``radixfleet.policies.base.Explanation``), the rule that decided and the outcome.
One entry per client request, written when its outcome is known (answered,
refused, or failed on every attempt); a retried request's entry is its last
attempt's decision (rule ``fallback``). Bounded: a ring of ``size`` entries, each
holding its explanation's references (the eligible views and the policy's two
lists: about 0.5 KB + 0.25 KB per eligible worker), the candidates derived only
when read. Keys are salted: a request's session and leading block appear only as
digests keyed by a secret drawn per ring (stable while the router runs, never
comparable across processes); no prompt text and no index hash is kept or shown.

Rules, from the decision's reason (``radixfleet.policies.base.Reason``) and the route core's
refusal (``radixfleet.route.core.Reject``)::

    affinity      the chosen worker had the best match (load allowing)
    load          load decided: a holder lost to a less loaded worker, or a miss
                  went to the least loaded one (spill_load, miss, balance, least_load)
    replication   a hot prefix's replica took it (replica)
    saturation    the policy's saturated-fleet rules decided (prefix_load: a holder
                  kept it whatever the score, or its prefix's home took it)
    placement     a policy that weighs neither (hash, round_robin, random)
    fallback      a retry on another worker after the first failed
    failed        a P/D prefill leg failed on every worker it tried (no decode
                  decision was made)
    shed          refused: every eligible worker saturated (429; the admission
                  queue's expiry too)
    refused       refused before a choice: rate limit, no worker, a bad body (the
                  error code says which)
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from radixfleet.policies.base import Explanation, Reason

if TYPE_CHECKING:
    from radixfleet.keys import PrefixKey
    from radixfleet.route.core import Placement, Route

#: the most decisions one ring keeps (``decisions.size``'s bound)
MAX_SIZE = 4096
#: candidates per decision shown by default, and at most (``?candidates=``)
DEFAULT_CANDIDATES = 8
MAX_CANDIDATES = 1024

_RULES = {
    Reason.AFFINITY.value: "affinity",
    Reason.SPILL_LOAD.value: "load",
    Reason.MISS.value: "load",
    Reason.BALANCE.value: "load",
    Reason.LEAST_LOAD.value: "load",
    Reason.REPLICA.value: "replication",
    Reason.HASH.value: "placement",
    Reason.ROUND_ROBIN.value: "placement",
    Reason.RANDOM.value: "placement",
    Reason.FALLBACK.value: "fallback",
}
RULES = (
    "affinity",
    "load",
    "replication",
    "saturation",
    "placement",
    "fallback",
    "failed",
    "shed",
    "refused",
)


class Quality(NamedTuple):
    """One answer's routing quality (module docstring), in tokens."""

    available: int
    predicted: int
    delivered: int | None


def quality(route: Route | None, pick: Placement, usage: tuple[int, int] | None) -> Quality:
    """The three numbers of an attempt placed as ``pick`` by ``route`` (None: the
    route is unknown, then nothing was available beyond the pick). O(workers)."""
    predicted = pick.blocks * pick.key.block_tokens
    available = route.available_tokens if route is not None else 0
    if usage is None:
        return Quality(max(available, predicted), predicted, None)
    prompt = usage[0]
    predicted = min(predicted, prompt)
    return Quality(max(min(available, prompt), predicted), predicted, usage[1])


def rule_of(reason: str, saturated: bool = False) -> str:
    """The rule of a decision with ``reason`` (a ``Reason`` value); ``saturated``: the
    policy's saturated-fleet rules decided."""
    rule = _RULES.get(reason, "placement")
    return "saturation" if saturated and rule != "fallback" else rule


class _Entry(NamedTuple):
    """One decision as the ring keeps it (cheap to build; ``DecisionRing.to_json``
    turns it into the endpoint's object)."""

    arrival_s: float  # UNIX seconds
    request_id: str
    model: str
    tenant: str
    session: str | None  # raw (shown only as a keyed digest)
    lead: int | None  # the request's first routing block hash (shown as a keyed digest)
    prompt_tokens: int  # the router's estimate
    policy: str
    reason: str  # the Decision's reason value, or the refusal's error code
    rule: str
    worker: str  # "" refused
    rank: int | None
    explained: Explanation | None
    quality: Quality | None
    status: int
    ttft_s: float | None
    broken: bool


class DecisionRing:
    """The last ``size`` decisions (module docstring). Only the data plane records;
    the admin API reads. One event loop owns it.

    Invariants (``check``): at most ``size`` entries, newest last; ``size`` in
    ``[0, MAX_SIZE]``; ``size`` 0 keeps nothing (``on`` is False)."""

    __slots__ = ("_ring", "_key")

    def __init__(self, size: int) -> None:
        self._ring: collections.deque[_Entry] = collections.deque(maxlen=self._bounded(size))
        #: the secret of this ring's digests (module docstring: salted keys only)
        self._key = os.urandom(16)

    @staticmethod
    def _bounded(size: int) -> int:
        if type(size) is not int or not 0 <= size <= MAX_SIZE:
            raise ValueError(f"a decision ring holds 0..{MAX_SIZE} entries, got {size!r}")
        return size

    @property
    def size(self) -> int:
        m = self._ring.maxlen
        assert m is not None  # always bounded
        return m

    @property
    def on(self) -> bool:
        """Whether decisions are kept (and routes need their explanation)."""
        return self.size > 0

    def __len__(self) -> int:
        return len(self._ring)

    def resize(self, size: int) -> None:
        """Keeps at most ``size`` entries from now on, the newest of those held."""
        if self._bounded(size) != self.size:
            self._ring = collections.deque(self._ring, maxlen=size)

    def record(
        self,
        key: PrefixKey,
        *,
        arrival_s: float,
        request_id: str,
        tenant: str,
        session: str | None,
        policy: str,
        route: Route | None,
        reason: str,
        worker: str,
        quality: Quality | None,
        status: int,
        ttft_s: float | None = None,
        broken: bool = False,
        shed: bool = False,
    ) -> None:
        """Keeps one request's decision: ``route`` (None: refused before a choice, or
        every attempt failed before one) with ``reason``, the worker and ``quality``
        of its answer, the ``status`` the client got. A refusal's ``reason`` is its
        error code, ``shed`` whether the shedder refused it. O(1)."""
        if route is None:
            explained, rank = None, None
            if shed:
                rule = "shed"
            elif worker:  # every attempt failed: the last worker tried, its route unknown
                rule = rule_of(reason) if reason else "failed"
            else:
                rule = "refused"
        else:
            explained = route.explained
            rank = route.placement.rank if route.placement is not None else None
            rule = rule_of(reason, explained is not None and explained.saturated)
        self._ring.append(
            _Entry(
                arrival_s,
                request_id,
                key.model,
                tenant,
                session,
                key.hashes[0] if key.hashes else None,
                key.prompt_tokens,
                policy,
                reason,
                rule,
                worker,
                rank,
                explained,
                quality,
                status,
                ttft_s,
                broken,
            )
        )

    def recent(self, n: int, candidates: int = DEFAULT_CANDIDATES) -> list[dict[str, Any]]:
        """The last ``n`` decisions, newest first, as the endpoint's objects, at most
        ``candidates`` candidates each. O(n x eligible log eligible)."""
        out = []
        ring = self._ring
        for i in range(len(ring) - 1, max(-1, len(ring) - 1 - n), -1):
            out.append(self.to_json(ring[i], candidates))
        return out

    def digest(self, data: bytes) -> str:
        """A keyed digest (16 hex digits) of ``data``: salted, so no one without this
        ring's secret can test a guessed prompt or session against it."""
        return hashlib.blake2b(data, key=self._key, digest_size=8).hexdigest()

    def to_json(self, e: _Entry, candidates: int) -> dict[str, Any]:
        q = e.quality
        ex = e.explained
        out: dict[str, Any] = {
            "time": round(e.arrival_s, 6),
            "request_id": e.request_id,
            "model": e.model,
            "tenant": e.tenant,
            "session": None if e.session is None else self.digest(e.session.encode("utf-8", "surrogatepass")),
            "prefix": None if e.lead is None else self.digest(e.lead.to_bytes(8, "little")),
            "prompt_tokens": e.prompt_tokens,
            "policy": e.policy,
            "rule": e.rule,
            "reason": e.reason,
            "worker": e.worker or None,
            "rank": e.rank,
            "eligible": ex.eligible if ex is not None else None,
            "candidates": [_candidate(c) for c in ex.candidates(candidates)] if ex is not None else [],
            "available_tokens": q.available if q is not None else None,
            "predicted_tokens": q.predicted if q is not None else None,
            "cached_tokens": q.delivered if q is not None else None,
            "outcome": {
                "status": e.status,
                "ttft_ms": None if e.ttft_s is None else round(e.ttft_s * 1000.0, 3),
                "broken": e.broken,
            },
        }
        return out

    def check(self) -> None:
        assert 0 <= self.size <= MAX_SIZE, f"{self.size=}"
        assert len(self._ring) <= self.size, f"{len(self._ring)=} > {self.size=}"
        for e in self._ring:
            assert e.rule in RULES, f"{e.rule=}"
            assert (e.rule in ("shed", "refused")) == (not e.worker), f"{e=}"


def _num(x: float | None, digits: int = 6) -> float | None:
    """A finite float rounded for JSON; None for None and infinities (an infinite
    score: a candidate the policy did not consider)."""
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits)


def _candidate(c) -> dict[str, Any]:
    return {
        "worker": c.worker,
        "matched_tokens": c.matched_tokens,
        "counted_tokens": c.counted_tokens,
        "queue_s": _num(c.queue_s),
        "in_flight": c.in_flight,
        "saturated": c.saturated,
        "score": _num(c.score),
        "expected_ttft_s": _num(c.expected_ttft_s),
    }


def now_unix(t0_monotonic: float) -> float:
    """UNIX seconds of a monotonic instant (a request's arrival)."""
    return time.time() - (time.monotonic() - t0_monotonic)
