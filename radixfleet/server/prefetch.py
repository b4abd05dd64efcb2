"""Prefetch: a cache fill with a predicted key (``POST /v1/prefetch``).

A client that knows its next prompt before it sends it (a retriever that runs ahead
of its generator, a chat UI while the user reads) posts that prompt, or its prefix,
to ``/v1/prefetch``. The data plane (``radixfleet.server.warm.Warmer.prefetch``) keys
it like the real request, picks the worker the normal pick path would, hints the
index (so the real request's match finds it there and follows it) and sends that
worker the prompt with ``max_tokens: 1``, not streamed, its answer discarded: the
same prefill-only request as a hot-root warm-up (``radixfleet.route.warmup``). The client
gets 202 at once.

A prefetch is speculative work, so it is the first thing dropped:

- ``PrefetchBudget``: ``prefetch.share`` of the fleet's prefill capacity (the sum
  of the routable workers' prefill rates, ``Worker.prefill_rate``), split among the
  tenants prefetching lately by their fair-share weights (``tenancy.queue.weights``):
  a token bucket per tenant, ``prefetch.burst_s`` seconds of its part at most. A
  prefetch costs its uncached tokens on the chosen worker from its tenant's bucket;
  one that does not fit is refused (429), nothing warmed. One tenant's flood empties
  its own bucket, never another's.
- the shedder's verdict at scale 1 and the admission limit: a router or fleet that
  would queue or shed a real request refuses the prefetch (429) instead.
- deduplication: a prefix the index already holds whole on the chosen worker is
  not sent again; a second prefetch of the same prompt finds the first one's hint.

What the answer says: the 202 tells a client with an identity — a tenant an API key
or a trusted gateway's header names, whose clients share its cache by configuration
— whether it was deduplicated (``deduplicated``), and gives a deduplicated one its
tokens back. A client without one (no tenants configured, or no key where keys are
optional: the default tenant, whose cache every such client shares) gets the same
202 either way, charged alike, so a prefetch cannot ask whether someone else sent a
text (``TenantResolver.anonymous``). What is left to such a client is what any shared
prefix cache leaves: the real request's latency, and the coarse Retry-After of a
budget its own prefetches spent (charged what is sent). Tenants keep clients apart.

Tenant limits: a prefetch is made with a tenant's key and charged to the tenant's
and the key's rate limits (``radixfleet.route.tenancy``) as the request it sends: one request,
and its prompt plus the one token it generates, reserved before the load and budget
checks (over a limit: 429 with the ``x-ratelimit-*`` headers, nothing warmed; the
202 carries them too). A prefetch dropped for load or budget gets its reservation
back, as a shed request does; a deduplicated one (nothing sent) keeps the request
and, for a client with an identity, gets its tokens back. The real request that
follows is charged in full, as any request is whatever its cache hit: a limit
counts what a tenant asks for, and a prefetch asks the fleet for a prefill of its
own — free prefetches would be a way around a tokens-per-minute limit.

The real request that follows a prefetch is not shed: its prefill was admitted (and
budgeted) as the prefetch's, which is still queued or running on its worker when the
lead is shorter than the prefill. Shedding it for that work would turn a prefetch
into a refusal (measured: a light RAG load saw 429s, because the fleet's typical
request, the real one after its prefetch, is small, and the prefetch queued ahead of
it is large).

``PrefetchLedger`` counts what prefetches were worth: a warmed prefix (worker, the
hash of its last block but one: the last may hold a chat template's closing tokens,
which the real request, whose message goes on, does not share) is *used* when a
later real request on that worker matched it,
*wasted* when ``prefetch.window_s`` passes first (``evicted`` when the index no
longer holds it then, ``unused`` when it does). Memory: at most ``max_tracked``
entries; past it the oldest are counted wasted early.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixfleet.config import PrefetchConfig
    from radixfleet.route.admission_queue import AdmissionQueueConfig

#: the path the router serves prefetches on
PREFETCH_PATH = "/v1/prefetch"
#: the most tenants with a bucket at once (the least recently seen is forgotten past it)
MAX_TENANTS = 1024


class PrefetchBudget:
    """Prefill tokens prefetches may spend: a token bucket per tenant, the rate of
    each set per take (the fleet's capacity changes as workers come, go and report
    rates, the tenants sharing it as they prefetch or stop)::

        part_t = rate x weight_t / (the weights of the tenants that tried within
                                    burst_s, t among them)
        cap_t  = part_t x burst_s          (a new bucket starts full)

    One tenant alone has the whole rate; tenants together have at most the whole
    rate (plus a newcomer's first burst), each its weighted part, and a take draws
    only on its own tenant's bucket. A tenant idle for ``burst_s`` is forgotten: its
    bucket would be full again by then. Memory: at most ``max_tenants`` buckets, the
    least recently tried forgotten past it. Only its owner calls it; nothing blocks.

    Invariants (``check()``): ``weight`` is the sum of the weights of the tenants
    with a bucket; every level is >= 0; at most ``max_tenants`` buckets, least
    recently tried first."""

    __slots__ = ("weights", "max_tenants", "_buckets", "_weight", "spent")

    def __init__(self, weights: Mapping[str, float] | None = None, max_tenants: int = MAX_TENANTS) -> None:
        self.weights: Mapping[str, float] = weights or {}  # tenant -> weight (others 1); set on reload
        self.max_tenants = max_tenants
        #: tenant -> [level (None: full), when it was last refilled]
        self._buckets: OrderedDict[str, list] = OrderedDict()
        self._weight = 0.0  # the weights of the tenants in _buckets
        self.spent = 0  # tokens taken since start

    def configure(self, queue: AdmissionQueueConfig) -> None:
        """Takes a reloaded ``tenancy.queue`` section: its weights, parts from now on."""
        self.weights = weights = queue.weights
        self._weight = sum(weights.get(t, 1.0) for t in self._buckets)

    def _forget(self) -> None:
        tenant, _ = self._buckets.popitem(last=False)
        self._weight = self._weight - self.weights.get(tenant, 1.0) if self._buckets else 0.0

    def take(self, tenant: str, tokens: int, rate: float, burst_s: float, now: float) -> float | None:
        """Takes ``tokens`` from ``tenant``'s bucket if it has them (its part of
        ``rate`` tokens/s, holding at most ``burst_s`` seconds of it): None. Else
        nothing is taken and the seconds until it would have them are returned
        (``inf`` when it never could: a zero rate, or more than its bucket holds).
        O(1) amortized."""
        b = self._buckets
        cutoff = now - burst_s
        while b and next(iter(b.values()))[1] < cutoff:
            self._forget()  # idle a whole burst: full again by now
        e = b.get(tenant)
        if e is None:
            if len(b) >= self.max_tenants:
                self._forget()
            e = b[tenant] = [None, now]
            self._weight += self.weights.get(tenant, 1.0)
        else:
            b.move_to_end(tenant)
        part = rate * self.weights.get(tenant, 1.0) / self._weight
        cap = part * burst_s
        level = cap if e[0] is None else min(cap, e[0] + max(0.0, now - e[1]) * part)
        e[1] = now
        if tokens <= level:
            e[0] = level - tokens
            self.spent += tokens
            return None
        e[0] = level
        if part <= 0 or tokens > cap:
            return math.inf
        return (tokens - level) / part

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self) -> None:
        total = sum(self.weights.get(t, 1.0) for t in self._buckets)
        assert abs(total - self._weight) <= 1e-6 * max(1.0, total), (total, self._weight)
        assert len(self._buckets) <= self.max_tenants, len(self._buckets)
        at = -math.inf
        for t, (level, when) in self._buckets.items():
            assert level is None or level >= 0, (t, level)
            assert when >= at, (t, when, at)
            at = when


class PrefetchLedger:
    """Warmed prefixes awaiting their real request: (worker, last block hash) ->
    (when warmed, the index holder it was hinted under: the worker, or one of its
    data-parallel ranks), oldest first. ``observe`` is called with every real
    request's matched blocks on its worker; ``sweep`` ends the ones past the window."""

    __slots__ = ("_open", "max_tracked")

    def __init__(self, max_tracked: int = 4096) -> None:
        self._open: OrderedDict[tuple[str, int], tuple[float, str]] = OrderedDict()
        self.max_tracked = max_tracked

    def configure(self, prefetch: PrefetchConfig) -> None:
        """Takes a reloaded ``prefetch`` section: its ``max_tracked`` (the oldest past it
        go at the next prefetch)."""
        self.max_tracked = prefetch.max_tracked

    def __len__(self) -> int:
        return len(self._open)

    def warmed(self, worker: str, last_hash: int, now: float, holder: str | None = None) -> int:
        """Records a prefetch of a prefix ending in ``last_hash`` on ``worker``.
        Returns how many older entries were pushed out past ``max_tracked`` (wasted)."""
        key = (worker, last_hash)
        self._open.pop(key, None)
        self._open[key] = (now, holder or worker)
        out = 0
        while len(self._open) > self.max_tracked:
            self._open.popitem(last=False)
            out += 1
        return out

    def pending(self, worker: str, matched: Sequence[int]) -> bool:
        """Whether a prefetch not yet used covers a block of ``matched`` on ``worker``
        (the real request it was made for has not come yet). Does not close it."""
        o = self._open
        return any((worker, h) in o for h in matched)

    def observe(self, worker: str, matched: Sequence[int]) -> int:
        """A real request matched the block hashes ``matched`` on ``worker``: the
        prefetches whose prefix it covers are used (and closed). Returns how many."""
        if not self._open:
            return 0
        used = 0
        for h in matched:
            if self._open.pop((worker, h), None) is not None:
                used += 1
        return used

    def sweep(self, now: float, window_s: float, held: Callable[[str, int], bool]) -> tuple[int, int]:
        """Closes the prefetches older than ``window_s``: (evicted, unused) — by
        whether ``held(holder, hash)`` says the index still holds the prefix."""
        evicted = unused = 0
        cutoff = now - window_s
        o = self._open
        while o:
            key, (t, holder) = next(iter(o.items()))
            if t > cutoff:
                break
            del o[key]
            if held(holder, key[1]):
                unused += 1
            else:
                evicted += 1
        return evicted, unused
