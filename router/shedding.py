"""Load shedding by default: a request is refused (429 + Retry-After) at once when
every worker that could serve it already has more prefill queued than it can
start soon, rather than queued behind minutes of work.

The bound is derived from the fleet, per worker, in seconds of queued prefill::

    pending_s(w) = (queued_tokens(w) + tokens picked for w since its report) / rate(w)
    bound_s      = max(limits.worker_queue_min_s,
                       limits.worker_queue_requests * typical_s)
    typical_s    = decayed mean of a request's uncached prefill seconds
                   (uncached tokens / the chosen worker's rate), per routed request

    shed  <=>  every eligible worker reports its load and pending_s(w) > bound_s

so admitted requests wait behind at most ``worker_queue_requests`` typical
requests' prefill — their time to first token stays within a small multiple of an
unloaded one — and the excess is told when to come back: ``Retry-After`` is the
time the least-loaded eligible worker needs to drain below the bound (>= 1 s).

Why the engine's reported queue and not the router's in-flight count: a request
the router counts stays counted until its first streamed byte, or for a
non-streaming request until its very end — a batch of long decodes would look
like a queue. The agent's (or engine's) own waiting queue is what delays a new
request's first token; the tokens picked since the last report cover a burst
between reports (~100 ms). A worker that reports no load is never full here (no
evidence of a queue: its own bounded queue answers 429), and neither is one whose
report is stale.

``Admission`` (the concurrency slot and its short queue in ``router.dataplane``)
stays the router's own backstop against more connections than it can hold.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from protocol.errors import Overloaded
from protocol.events import MAX_RATE, MIN_RATE
from router.served import serves

#: weight of the newest request in typical_s (about the last 50 requests count)
_ALPHA = 0.02


class Shedder:
    """The fleet's queue bound. One event loop owns it; ``check`` is O(workers).

    ``typical_s`` is the only state (0.0 until the first observation, which it
    then takes whole); ``configure`` follows a reload."""

    __slots__ = ("per_requests", "min_s", "typical_s", "on_shed")

    def __init__(self, per_requests: float, min_s: float,
                 on_shed: Callable[[], None] | None = None) -> None:
        self.per_requests = per_requests  # 0: never shed
        self.min_s = min_s
        self.typical_s = 0.0
        self.on_shed = on_shed  # a metric

    def configure(self, per_requests: float, min_s: float) -> None:
        self.per_requests, self.min_s = per_requests, min_s

    def bound_s(self) -> float:
        b = self.per_requests * self.typical_s
        return b if b > self.min_s else self.min_s

    def check(self, workers: Iterable, model: str, adapter: str | None, uncached_tokens: int,
              now: float) -> Overloaded | None:
        """An ``Overloaded`` to answer with if every eligible worker (routable
        ``workers`` serving model/adapter) is past the bound, else None. Also
        records the request's uncached prefill in ``typical_s``."""
        if self.per_requests <= 0:
            return None
        bound = self.bound_s()
        best = math.inf
        for w in workers:
            if model and w.models and not serves(w.models, model, adapter):
                continue
            ld = w.load
            if ld is None or now >= w.load_until:
                return self._observe(uncached_tokens, w.base_prefill)
            rate = ld.prefill_tokens_per_s or w.base_prefill
            rate = MIN_RATE if rate < MIN_RATE else MAX_RATE if rate > MAX_RATE else rate
            q = (ld.queued_tokens + w.since_report_tokens) / rate
            if q <= bound:
                return self._observe(uncached_tokens, rate)
            if q < best:
                best = q
        if best == math.inf:
            return None  # nobody eligible: the caller's 404 / 503
        if self.on_shed is not None:
            self.on_shed()
        return Overloaded(f"every worker serving this model has over {bound:.2f}s of prefill "
                          f"queued (the least {best:.2f}s); retry later",
                          retry_after_s=best - bound)

    def _observe(self, tokens: int, rate: float) -> None:
        s = tokens / (rate if rate >= MIN_RATE else MIN_RATE)
        t = self.typical_s
        self.typical_s = s if t == 0.0 else t + _ALPHA * (s - t)
        return None
