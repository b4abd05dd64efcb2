"""Load shedding by default: a request is refused (429 + Retry-After) at once when
every worker that could serve it is saturated — by what the worker itself reports —
rather than queued behind seconds of work. Below saturation nothing is shed.

Per worker, from its last load report (an agent's push, or an engine's ``/metrics``
read by ``radixfleet.engines.link``) and what the router has done since (``QueueMark``)::

    room        the report is missing or stale and the worker never showed a
                saturated queue (no evidence of one), or
                an engine never held a waiting queue over two reports, or
                an engine has a free slot and its KV is not full:
                    others + in_flight < L
                    others = max(0, running + waiting (reported) - seen)
                L its learned batch limit, or before that is learned the most it
                ever ran at once (a slot count it has shown it has; a waiting
                queue below it waits for a step's token budget: its requests
                count as running ones do)
    pending_s   = queued_tokens / rate  +  picked_since / rate  -  age     (>= 0)
                the reported queue, the uncached tokens picked for the worker since,
                less what the worker prefilled meanwhile at its learned rate
                (engines' scrapes only: agents' ~100 ms reports are not aged)
    bound_s     = max(limits.worker_queue_min_s,
                      limits.worker_queue_requests * typical_s)
    typical_s   = decayed mean of a request's uncached prefill seconds (prefetches,
                  max_tokens 1 warm-ups of a later request, not counted)

    ahead_s     = uncached tokens the router sent the worker that have not reached
                  their first token yet (streams: released at it) / rate

    shed  <=>  no eligible worker has room and every one has pending_s > bound_s

The rules beside the table (each one's measurements and the incidents that set it:
``docs/decisions/shedding.md``):

- A saturated engine (one that has held a waiting queue in two reports in a row) has
  room only with a free slot and at most one request's prefill ahead: ``ahead_s``
  within the bound, or the tokens ahead within ``largest_tokens`` (a decayed maximum
  of requests' uncached tokens; two of them while its report shows it quiet); its
  ``pending_s`` is at least ``ahead_s``. "One request" is counted in tokens, not in
  seconds of a typical request.
- ``in_flight`` is the router's own count on the worker now (other replicas'
  included); ``seen`` is the most it had in flight there since the report before.
  What the engine reports beyond ``seen`` is other routers' work sharing it.
- An engine is judged saturated only on its own evidence. Its batch limit L (vLLM's
  ``max_num_seqs``, unpublished) is learned as the most requests it ever reported
  running, once two reports in a row showed a waiting queue at that ceiling; until
  then the most it ran at once. So with the limits learned and one router, a closed
  loop of at most the fleet's batch limits in clients is never shed. Agents have no
  batch limit and are judged by ``pending_s`` alone, on their whole waiting prompts
  (``Load.queued_tokens``), not only the prefill they need now.
- A saturated engine whose report goes stale is judged on the router's own counts (an
  empty report: its slots against the router's in-flight requests, the prefill sent
  that has not reached a first token). An engine that never saturated, and an agent,
  keep "no report means room".
- An engine's reported queue is aged by what it prefilled since the scrape, at its
  learned rate (agents' ~100 ms reports are not aged).
- On an engine whose report shows it quiet (nothing waiting, under half its limit
  running) ``QUIET_AHEAD`` requests' prefill may be ahead of a free slot, one otherwise.
- While the router has shed nothing for ``CALM_S`` seconds, an engine with a free slot
  and a fresh report takes a request while the prefill ahead on it is within
  ``BURST_AHEAD`` of the largest recent request's; once anything is shed the plain
  rules hold for ``CALM_S``. Agents have no such allowance.

Admitted requests then wait behind at most ``worker_queue_requests`` typical
requests' prefill; the excess is told when to come back: ``Retry-After`` is the
time the least-loaded eligible worker needs to drain below the bound (>= 1 s).

``Admission`` (the concurrency slot and its short queue in ``radixfleet.server.dataplane``)
stays the router's own backstop against more connections than it can hold.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from radixfleet.wire.errors import Overloaded
from radixfleet.wire.events import MAX_RATE, MIN_RATE, Load

if TYPE_CHECKING:
    from radixfleet.config import LimitsConfig

log = logging.getLogger(__name__)

#: shed decisions kept with their inputs (``Shedder.recent``, ``GET /admin/workers``)
RECENT_SHEDS = 32
#: weight of the newest request in typical_s (about the last 50 requests count)
_ALPHA = 0.02
#: an engine whose KV is at least this full has no room whatever its batch count
KV_FULL = 0.95
#: requests' prefill (in largest requests) that may be ahead of a free slot on an
#: engine whose report shows it quiet (module docstring)
QUIET_AHEAD = 2.0
#: while nothing was shed for CALM_S seconds, requests' prefill (in largest requests)
#: that may be ahead of a free slot on an engine with a fresh report: a burst, not
#: saturation (module docstring)
BURST_AHEAD = 4.0
#: seconds after a refusal during which the fleet is not calm, and the refused
#: request's workers read saturated to the policy (radixfleet.fleet.pool.Pool.refused)
CALM_S = 5.0


class QueueMark:
    """What a worker's last load report said about its room, and what the router sent
    it since. Only ``radixfleet.fleet.pool.Pool`` changes it (on reports, picks and restarts).

    Invariants (``check()``): counts >= 0; ``limit`` is 0 or equals ``running_max``
    at the time it was confirmed (it never exceeds ``running_max``); a limit is only
    known once a queue has held (``limit => queue_held``)."""

    __slots__ = (
        "at",
        "in_flight",
        "peak",
        "since_tokens",
        "engine",
        "queue_held",
        "running_max",
        "limit",
        "_queued",
        "_queued_at_max",
    )

    def __init__(self) -> None:
        self.at = 0.0  # monotonic time of the last report
        #: ``seen``: the router's in-flight count on the worker that the report
        #: already holds, the most it had there since the report before (module docstring)
        self.in_flight = 0
        self.peak = 0  # the most the router had in flight on the worker since the report
        self.since_tokens = 0  # uncached tokens picked for the worker since that report
        self.engine = False  # the reports come from an engine's own metrics
        #: an engine reported a waiting queue twice in a row since it started: it has
        #: been saturated (until then it is never full: no evidence of a queue)
        self.queue_held = False
        self.running_max = 0  # most running requests an engine report ever showed
        self.limit = 0  # learned batch limit (0: unknown; engines only)
        self._queued = False  # the previous report showed a waiting queue
        self._queued_at_max = False  # ... with running at its max

    def reported(self, load: Load, now: float, in_flight: int, engine: bool) -> None:
        """A new report. ``engine``: the load came from an engine's own metrics (a
        batch limit can be learned), not from an agent."""
        self.at = now
        self.in_flight = self.peak if self.peak > in_flight else in_flight
        self.peak = in_flight
        self.since_tokens = 0
        self.engine = engine
        if not engine:
            return
        queued = load.queued_requests > 0
        if queued and self._queued:
            self.queue_held = True
        self._queued = queued
        run = load.running_requests
        if run > self.running_max:
            self.running_max = run
            self.limit = 0  # a higher ceiling: the old one was not the limit
            self._queued_at_max = False
        kv_full = load.kv_capacity_tokens > 0 and load.kv_used_tokens >= KV_FULL * load.kv_capacity_tokens
        at_max = queued and run == self.running_max > 0 and not kv_full
        if at_max and self._queued_at_max:
            self.limit = run
        self._queued_at_max = at_max

    def picked(self, tokens: int, in_flight: int) -> None:
        """A pick for the worker: ``tokens`` uncached, ``in_flight`` the router's count
        on it now (this pick included)."""
        self.since_tokens += tokens
        if in_flight > self.peak:
            self.peak = in_flight

    def describe(self) -> dict:
        """What shedding has learned of the worker (``GET /admin/workers``)."""
        return {
            "limit": self.limit,
            "running_max": self.running_max,
            "queue_held": self.queue_held,
            "in_flight_at_report": self.in_flight,
        }

    def forget(self) -> None:
        """A new engine process: its limits may differ."""
        self.running_max = self.limit = 0
        self.queue_held = self._queued = self._queued_at_max = False

    def check(self) -> None:
        assert self.in_flight >= 0 and self.peak >= 0 and self.since_tokens >= 0 and self.running_max >= 0, (
            self.in_flight,
            self.peak,
            self.since_tokens,
            self.running_max,
        )
        assert 0 <= self.limit <= self.running_max, (self.limit, self.running_max)
        assert not self.limit or self.queue_held, (self.limit, self.queue_held)


def has_room(mark: QueueMark, load: Load, in_flight: int) -> bool:
    """Whether an engine can start one more request now: it has never held a waiting
    queue (no evidence it ever saturates), or it has fewer requests on it than its
    learned batch limit — or, before that is learned, than it has run at once — and
    KV to spare. A reported waiting queue counts among the requests on it: below
    the most it ran at once it is a step's token budget, not a lack of slots."""
    if mark.engine and not mark.queue_held:
        return True
    if load.kv_capacity_tokens > 0 and load.kv_used_tokens >= KV_FULL * load.kv_capacity_tokens:
        return False
    ceiling = mark.limit or mark.running_max
    others = load.running_requests + load.queued_requests - mark.in_flight
    return (others if others > 0 else 0) + in_flight < ceiling


def pending_s(mark: QueueMark, load: Load, rate: float, now: float) -> float:
    """Seconds of prefill queued on the worker now (module docstring), >= 0. An
    agent's report is at most ~100 ms old and is not aged (measured: aging it let
    ``radixfleet bench overload``'s admitted TTFT p99 go from 2.2x to 3.2x the
    unloaded one); an engine's scrape is up to a second old and is."""
    q = (load.queued_tokens + mark.since_tokens) / rate
    if mark.engine:
        q -= now - mark.at
    return q if q > 0.0 else 0.0


def quiet(mark: QueueMark, load: Load) -> bool:
    """Whether an engine's report shows it far from saturation: nothing waiting and
    fewer than half its batch limit (or the most it ran) running."""
    ceiling = mark.limit or mark.running_max
    return load.queued_requests == 0 and 2 * load.running_requests < ceiling


class Shedder:
    """The fleet's queue bound. One event loop owns it; ``check`` is O(workers).

    ``typical_s`` and ``largest_tokens`` (0.0 until the first observation, which they
    then take whole) and ``shed_at`` (when the last request was shed) are the only
    state; ``configure`` follows a reload."""

    __slots__ = ("per_requests", "min_s", "typical_s", "largest_tokens", "shed_at", "on_refuse", "recent")

    def __init__(
        self,
        per_requests: float,
        min_s: float,
        on_refuse: Callable[[str, str | None, float], None] | None = None,
    ) -> None:
        self.per_requests = per_requests  # 0: never shed
        self.min_s = min_s
        self.typical_s = 0.0
        #: the largest recent request's uncached tokens (decayed by _ALPHA per request):
        #: one request of that size ahead on a worker is room (module docstring)
        self.largest_tokens = 0.0
        #: the ``now`` of the last shed decision (-inf: none yet, the fleet is calm)
        self.shed_at = -math.inf
        #: told (model, adapter, now) of each refusal: ``radixfleet.fleet.pool.Pool.refused``, so
        #: policies see the workers saturated (``WorkerView.saturated``)
        self.on_refuse = on_refuse
        #: the last RECENT_SHEDS shed decisions, each with every eligible worker's inputs
        self.recent: deque[dict] = deque(maxlen=RECENT_SHEDS)

    def configure(self, limits: LimitsConfig) -> None:
        """Takes a reloaded ``limits`` section: its shedding bound from now on."""
        self.per_requests, self.min_s = limits.worker_queue_requests, limits.worker_queue_min_s

    def bound_s(self) -> float:
        b = self.per_requests * self.typical_s
        return b if b > self.min_s else self.min_s

    def check(
        self,
        workers: Iterable,
        model: str,
        adapter: str | None,
        uncached_tokens: int,
        now: float,
        scale: float = 1.0,
        *,
        prefetch: bool = False,
    ) -> Overloaded | None:
        """An ``Overloaded`` to answer with if every eligible worker (routable
        ``workers`` serving model/adapter) is saturated past the bound, else None.
        Also records the request's uncached prefill in ``typical_s`` (not a
        ``prefetch``'s: its warm-up prefill is no request's size, and the real request
        that follows it, small since it hits, would be the one counted twice) and in
        ``largest_tokens`` (a prefetch's too: its prefill sits ahead on the worker as
        a request's does).

        ``scale`` (> 0): the request's priority class's factor on the bound
        (radixfleet.route.tenancy). The decision is monotone in the bound, so a request with a
        larger factor is admitted whenever one with a smaller factor would be."""
        if self.per_requests <= 0:
            return None
        bound = self.bound_s() * scale
        # calm (nothing shed lately): a burst's prefill may queue (module docstring)
        burst_tokens = self.largest_tokens * BURST_AHEAD if now - self.shed_at >= CALM_S else 0.0
        best = math.inf
        for w in workers:
            if not w.serves(model, adapter):
                continue
            ld, mark = w.load, w.mark
            stale = ld is None or now >= w.load_until
            if stale:
                if ld is None or not (mark.engine and mark.queue_held):
                    self._observe(uncached_tokens, w.base_prefill, prefetch)
                    return None
                # a saturated engine's scrapes stopped arriving: its own counts
                ld = Load(prefill_tokens_per_s=ld.prefill_tokens_per_s)
            rate = ld.prefill_tokens_per_s or w.base_prefill
            rate = MIN_RATE if rate < MIN_RATE else MAX_RATE if rate > MAX_RATE else rate
            in_flight = w.in_flight + w.remote_in_flight
            q = pending_s(mark, ld, rate, now)
            if mark.engine and mark.queue_held:
                # an engine that has saturated: a free slot takes the request unless
                # the prefill the router already sent it and not yet seen start
                # (released at each first token) is more than one request's — a
                # slot is no promise of a first token soon — or, on an engine its
                # own report shows quiet, two requests' (a burst into idle slots)
                ahead_tokens = w.in_flight_tokens + w.remote_tokens
                ahead = ahead_tokens / rate
                # (an empty stand-in for a stale report is no evidence of quiet)
                allowed = self.largest_tokens * (QUIET_AHEAD if not stale and quiet(mark, ld) else 1.0)
                if burst_tokens > allowed and not stale:
                    allowed = burst_tokens
                if (ahead <= bound or ahead_tokens <= allowed) and has_room(mark, ld, in_flight):
                    self._observe(uncached_tokens, rate, prefetch)
                    return None
                if ahead > q:
                    q = ahead
            elif has_room(mark, ld, in_flight):
                self._observe(uncached_tokens, rate, prefetch)
                return None
            if q <= bound:
                self._observe(uncached_tokens, rate, prefetch)
                return None
            if q < best:
                best = q
        if best == math.inf:
            return None  # nobody eligible: the caller's 404 / 503
        self.shed_at = now
        if self.on_refuse is not None:
            self.on_refuse(model, adapter, now)
        self._record(workers, model, adapter, bound, now)
        return Overloaded(
            f"every worker serving this model has over {bound:.2f}s of prefill "
            f"queued (the least {best:.2f}s); retry later",
            retry_after_s=best - bound,
        )

    def _record(self, workers: Iterable, model: str, adapter: str | None, bound: float, now: float) -> None:
        """Keeps a shed decision's inputs per eligible worker (and logs them at debug)."""
        rows = []
        for w in workers:
            if not w.serves(model, adapter):
                continue
            ld, mark = w.load, w.mark
            rate = ld.prefill_tokens_per_s or w.base_prefill
            rate = MIN_RATE if rate < MIN_RATE else MAX_RATE if rate > MAX_RATE else rate
            rows.append(
                {
                    "id": w.id,
                    "running": ld.running_requests,
                    "waiting": ld.queued_requests,
                    "in_flight": w.in_flight + w.remote_in_flight,
                    "mark_in_flight": mark.in_flight,
                    "limit": mark.limit,
                    "running_max": mark.running_max,
                    "queue_held": mark.queue_held,
                    "report_age_s": round(now - mark.at, 3),
                    "pending_s": round(pending_s(mark, ld, rate, now), 3),
                    # the agent's waiting queue as prefill needed now (Load)
                    "prefill_s": round(ld.queued_prefill_tokens / rate, 3),
                    "ahead_s": round((w.in_flight_tokens + w.remote_tokens) / rate, 3),
                    "quiet": quiet(mark, ld),
                }
            )
        entry = {"bound_s": round(bound, 3), "workers": rows}
        self.recent.append(entry)
        log.debug("shed: %s", entry)

    def _observe(self, tokens: int, rate: float, prefetch: bool) -> None:
        """Records an admitted request's uncached prefill in typical_s (not a
        prefetch's) and largest_tokens."""
        if not prefetch:
            s = tokens / (rate if rate >= MIN_RATE else MIN_RATE)
            t = self.typical_s
            self.typical_s = s if t == 0.0 else t + _ALPHA * (s - t)
        big = self.largest_tokens * (1.0 - _ALPHA)
        self.largest_tokens = tokens if tokens > big else big
