"""What an engine's waiting queue costs a new request, from its /metrics (contract 10,
docs/DESIGN.md).

An engine's page says how many requests wait (``vllm:num_requests_waiting``), not
how big they are nor how long they will wait, and the policy prices a worker's
queue in prefill tokens (``queue_s = queued_tokens / prefill rate``). A queue the
router did not fill itself — another router's, or clients that call the engine
directly — is therefore priced from two estimates, and the larger wins:

- **work**: ``waiting x tokens per request``, the request size being the larger
  of the fleet's mean uncached prompt (the router's own requests; passed in) and
  this engine's recent mean uncached prompt per prefilled request,
  ``d(prefix-cache queries - hits) / d(requests past their first token)`` from its
  counters. The fleet mean alone priced a queue of foreign 1,200-token prompts at
  ~23 tokens each (the router's own requests were mostly cached) and the busy
  holder of a conversation kept it; the engine's own mean alone made a worker
  holding many sessions (short uncached parts) look idle.
- **time**: ``waiting / departures per second`` (Little's law). Requests leave an
  engine's queue as fast as its running slots and KV free up (``max-num-seqs``):
  behind long decodes that is far slower than prefill, and a work estimate would
  call a queue of short prompts cheap. Departures are counted only over intervals
  that began and ended with a non-empty queue: an engine that is not saturated
  departs at its arrival rate, which says nothing about its capacity — counting a
  request caught waiting one scheduler step at a scrape would price a lightly used
  worker's queue by its few arrivals, make it look long, and send new sessions to
  the busy one. As a ratio of exponentially decayed sums
  with time constant ``tau_s`` (bursty departures — a batch of eight finishing
  together — average out). The wait is converted to prefill-token equivalents at
  the worker's prefill rate, the unit the policy divides by.

Counters that go backwards (an engine restart) restart the estimate. The result
is capped at ``MAX_LOAD_COUNT`` (the bound of every reported load number).

Pure: no I/O, no clock of its own (``now`` is any monotonic seconds).

Invariants (``check()``): the decayed sums are finite and >= 0; the per-request
estimate is finite and >= 0.
"""

from __future__ import annotations

import math

from radixfleet.wire.events import MAX_LOAD_COUNT

#: decayed sums' time constant, seconds: a few engine batches
DEFAULT_TAU_S = 5.0
#: weight of one interval's per-request size in the decayed mean (per request seen)
_SIZE_ALPHA = 0.2
#: fewest decayed departure-seconds before the time estimate is trusted
_MIN_BUSY_S = 0.2


class QueueEstimate:
    """Per-worker estimator fed with each fresh /metrics reading."""

    __slots__ = ("tau_s", "_last", "_dep_n", "_dep_t", "_size")

    def __init__(self, tau_s: float = DEFAULT_TAU_S) -> None:
        if not (math.isfinite(tau_s) and tau_s > 0):
            raise ValueError(f"tau_s must be finite and > 0, got {tau_s}")
        self.tau_s = tau_s
        # previous reading: (now, waiting, prefilled, queries, hits)
        self._last: tuple[float, int, float | None, float | None, float | None] | None = None
        self._dep_n = 0.0  # decayed departures while the queue was non-empty
        self._dep_t = 0.0  # decayed seconds of such intervals
        self._size = 0.0  # decayed mean uncached tokens per prefilled request (0: unknown)

    def observe(
        self, now: float, waiting: int, prefilled: float | None, queries: float | None, hits: float | None
    ) -> None:
        """One reading: waiting requests and the engine's counters (None: not
        published). Out-of-order or repeated ``now`` is ignored."""
        last = self._last
        if last is not None and not now > last[0]:
            return
        self._last = (now, waiting, prefilled, queries, hits)
        if last is None:
            return
        t0, w0, p0, q0, h0 = last
        if prefilled is None or p0 is None:
            return
        dn = prefilled - p0
        if dn < 0 or (queries is not None and q0 is not None and queries < q0):
            self._dep_n = self._dep_t = self._size = 0.0  # a new engine process
            return
        dt = now - t0
        decay = math.exp(-dt / self.tau_s)
        if w0 > 0 and waiting > 0:
            self._dep_n = self._dep_n * decay + dn
            self._dep_t = self._dep_t * decay + dt
        if dn >= 1 and queries is not None and q0 is not None and hits is not None and h0 is not None:
            per = max(0.0, (queries - q0) - (hits - h0)) / dn
            a = 1.0 - (1.0 - _SIZE_ALPHA) ** dn
            self._size = per if self._size == 0 else self._size + a * (per - self._size)

    def reset(self) -> None:
        self._last = None
        self._dep_n = self._dep_t = self._size = 0.0

    @property
    def tokens_per_request(self) -> float:
        """The engine's recent mean uncached prompt per prefilled request (0: unknown)."""
        return self._size

    @property
    def departures_per_s(self) -> float | None:
        """Requests leaving a non-empty queue per second, or None before enough busy
        time was seen."""
        if self._dep_t < _MIN_BUSY_S:
            return None
        return self._dep_n / self._dep_t

    def queued_tokens(
        self, waiting: int, fleet_tokens_per_request: float, prefill_tokens_per_s: float
    ) -> int:
        """The queue of ``waiting`` requests in prefill-token equivalents."""
        if waiting <= 0:
            return 0
        work = waiting * max(fleet_tokens_per_request, self._size)
        dep = self.departures_per_s
        if dep is not None:
            # no departures at all over the window: the queue is stuck behind its
            # running requests; the window's length bounds what is known of the wait
            wait_s = waiting / dep if dep > 0 else waiting * self._dep_t
            work = max(work, wait_s * prefill_tokens_per_s)
        if not math.isfinite(work):
            return MAX_LOAD_COUNT
        return int(min(work, MAX_LOAD_COUNT))

    def check(self) -> None:
        for name in ("_dep_n", "_dep_t", "_size"):
            v = getattr(self, name)
            assert math.isfinite(v) and v >= 0, (name, v)
