"""What one routed request owes the router after its pick: ``RequestLedger``.

``RouteCore.decide`` counts a ``Route``'s load on its worker before it returns
(``Placement``: ``own`` uncached prompt tokens as queued prefill, the prompt's KV
held); whoever carries the bytes must give it back, learn from the answer and count
the outcome. The ledger is that bookkeeping for one attempt on one worker, for every
carrier (the data plane's attempts, radixfleet.server.attempts; its prefetches and P/D
prefill legs; the gateway's endpoint picker, radixfleet.gateway), told by hooks in the order
the answer unfolds::

    RequestLedger(parts, worker, placement, request)  at the pick
       first_byte(now)       the answer's head: time to first byte (``counted``
                             False: a head that is no answer, a 5xx or 429 about to
                             be retried, only timed for the trace)
       stream(watch)         a relayed stream's ``StreamWatch`` (what it cost)
       first_token(now)      the first CONTENT token (radixfleet.server.sse): the prompt is no
                             longer queued prefill on the worker (pool.prefilled),
                             the TTFT and the prefill-rate sample's time
       usage(usage, output)  (prompt, cached) and completion tokens it reported
       end(ok, status, now)  the answer ended: ok True (answered, any status the
                             worker chose: 4xx and 429 too), False (the worker
                             failed: 5xx, broke off, refused the connection), None
                             (neither); status: what the client got, None for none;
                             ``broken``: the worker broke off a stream the client
                             had begun (status 200, its end an SSE error: counted
                             as a 502 answer)
       cancel(now)           the carrier gave up (client gone, stream broken):
                             end(None, None)

A ledger made with ``route`` counts each end's quality (``radixfleet.route.decisions.quality``:
available, predicted, delivered tokens) with the outcome and in the traffic log; one
made with ``counted=False`` is a leg whose answer is not the client's (a prefetch's
warm-up, a P/D prefill leg): its end releases the load and tells the pool the outcome
(its breaker), and counts, charges, logs and teaches nothing.

Invariants (``check``):

- the load counted at the pick is released exactly once: ``own`` tokens of queued
  prefill leave at ``first_token`` or, if none came, at the end; the request and its
  KV at the end (``pool.finish``), whichever of ``end``/``cancel`` comes first;
- every hook is idempotent and none does anything after the end (a late
  ``first_token`` after a cancel releases nothing twice);
- ``left`` (tokens still counted as queued prefill) is ``own`` until the first token
  and 0 from then on;
- the outcome is counted once (``metrics.answered``; ``request_done`` only with a
  status), the tenant's limits charged once with what the engine did
  (``Tenancy.charge``: an end that tells nothing leaves the ticket open for a
  retry's), and the engine link learns only from an ``ok`` answer; an uncounted
  ledger counts, charges and teaches nothing.

Not here: the admission slot and the tenancy ticket's admission (per client
request, not per attempt), the reply itself, the decision ring (its entry names the
client request: the carrier records it from ``quality`` and ``status``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from radixfleet.route.decisions import quality

if TYPE_CHECKING:
    from radixfleet.fleet.pool import Pool, Worker
    from radixfleet.keys import PrefixKey
    from radixfleet.route.admission_queue import AdmissionQueue
    from radixfleet.route.core import Placement, Route
    from radixfleet.route.decisions import Quality
    from radixfleet.route.tenancy import Tenancy, Ticket
    from radixfleet.server.context import RequestContext
    from radixfleet.server.metrics import Metrics
    from radixfleet.server.sse import StreamWatch
    from radixfleet.server.traffic_log import TrafficLog

log = logging.getLogger("radixfleet.router")


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerParts:
    """What a ledger settles with: the router's objects, shared by every ledger."""

    pool: Pool
    metrics: Metrics
    tenancy: Tenancy | None = None
    queue: AdmissionQueue | None = None  # kicked when a worker may have room
    traffic: TrafficLog | None = None


class RequestLedger:
    """One attempt's bookkeeping from its pick to its end (module docstring)."""

    __slots__ = (
        "parts",
        "worker",
        "link",
        "pick",
        "ticket",
        "key",
        "model",
        "reason",
        "session",
        "route",
        "counted",
        "t0",
        "sent",
        "head",
        "left",
        "ttfb",
        "ttft",
        "prompt_cached",
        "output",
        "quality",
        "watch",
        "status",
        "ok",
        "broken",
        "ended",
    )

    def __init__(
        self,
        parts: LedgerParts,
        worker: Worker,
        pick: Placement,
        request: RequestContext | None = None,
        *,
        reason: str | None = None,
        route: Route | None = None,
        counted: bool = True,
    ) -> None:
        """``request``: the client request the attempt serves (its ticket, key, reason,
        session, arrival); None: a leg no client request is charged for, timed from
        now. ``reason``: why the worker was chosen, when not the request's."""
        self.parts = parts
        self.worker = worker
        self.link = worker.engine  # the link the pick counted on (a reload may replace w's)
        self.pick = pick
        now = time.monotonic()
        if request is not None:
            self.ticket: Ticket | None = request.ticket
            #: the request's byte-space key (the traffic log's); None: not logged
            self.key: PrefixKey | None = request.key
            self.session: str | None = request.session
            self.t0 = request.t0  # the client request's arrival
            self.reason = request.reason if reason is None else reason  # (metrics)
        else:
            self.ticket = self.key = self.session = None
            self.t0 = now
            self.reason = reason or ""
        self.model = self.key.model if self.key is not None else ""  # the metrics' label
        self.route = route  # the pick's route: its quality counted (module docstring)
        self.counted = counted  # False: a leg whose answer is not the client's
        self.sent = now  # this attempt's start (the TTFT sample's origin)
        self.head: float | None = None  # when the answer's head came
        #: prompt tokens still counted on the worker as queued prefill
        self.left = pick.own
        self.ttfb: float | None = None  # arrival -> the answer's head
        self.ttft: float | None = None  # sent -> first content token
        #: (prompt_tokens, cached_tokens) the worker reported
        self.prompt_cached: tuple[int, int] | None = None
        self.output: int | None = None  # completion tokens the worker reported
        #: the try's quality, counted at the end (with ``route``; else None)
        self.quality: Quality | None = None
        self.watch: StreamWatch | None = None  # a relayed stream's (radixfleet.route.tenancy reads it)
        self.status: int | None = None  # what the client got; None: nothing
        self.ok: bool | None = None
        self.broken = False  # the worker broke off after the client had its head
        self.ended = False  # end() or cancel() ran: nothing more is counted

    # ------------------------------------------------------------------ hooks

    def first_byte(self, now: float, *, counted: bool = True) -> None:
        """The answer's head arrived (once; nothing after the end); ``counted``
        False: a head that is no answer (a 5xx or 429), timed but not observed."""
        if self.ended or self.head is not None:
            return
        self.head = now
        if counted:
            self.ttfb = now - self.t0
            self.parts.metrics.observe_ttfb(self.ttfb)

    def stream(self, watch: StreamWatch) -> None:
        """The answer is a stream relayed through ``watch`` (the tenant's charge
        reads its own count of what passed)."""
        if not self.ended:
            self.watch = watch

    def first_token(self, now: float) -> None:
        """The first content token passed: the prompt is prefilled, no longer queued
        work on the worker (once; nothing after the end)."""
        if self.ended or self.ttft is not None:
            return
        p = self.parts
        self.ttft = now - self.sent
        p.metrics.observe_ttft(now - self.t0)
        p.pool.prefilled(self.worker, self.left)
        self.left = 0
        if p.queue is not None:
            p.queue.kick(now)  # the worker may have room

    def usage(self, usage: tuple[int, int] | None, output: int | None = None) -> None:
        """What the worker reported: (prompt, cached) tokens and completion tokens
        (None: not reported; a later report replaces an earlier one)."""
        if self.ended:
            return
        if usage is not None:
            self.prompt_cached = usage
        if output is not None:
            self.output = output

    def end(self, ok: bool | None, status: int | None, now: float, *, broken: bool = False) -> bool:
        """The attempt ended (module docstring). Releases what the pick counted, counts
        the outcome, charges the tenant and, for an ``ok`` answer, teaches the engine
        link. Returns False when it had ended already (nothing done)."""
        if self.ended:
            return False
        self.ended = True
        self.ok, self.status, self.broken = ok, status, broken
        p, w, pick = self.parts, self.worker, self.pick
        p.pool.finish(w, self.left, ok, pick.key.prompt_tokens)
        self.left = 0
        if p.queue is not None:
            p.queue.kick(now)  # w may have room
        link = self.link
        if pick.rank is not None and link is not None:
            link.rank_finished(pick.rank)
        if not self.counted:
            return True
        usage = self.prompt_cached
        q = None
        if self.route is not None:
            q = self.quality = quality(self.route, pick, usage)
        m = p.metrics
        if status is not None:
            m.request_done(w.id, 502 if broken else status, self.reason)
            m.observe_latency(now - self.t0)
        m.answered(w.id, self.model, ok, usage, q)
        if p.traffic is not None and status is not None and self.key is not None:
            p.traffic.record(
                self.key,
                arrival_s=time.time() - (now - self.t0),
                worker=w.id,
                matched_tokens=pick.blocks * pick.key.block_tokens,
                available_tokens=q.available if q is not None else 0,
                prompt_tokens=usage[0] if usage else None,
                output_tokens=self.output,
                cached_tokens=usage[1] if usage else None,
                ttft_s=self.ttft,
                status=status,
                broken=broken,
                session=self.session,
            )
        if p.tenancy is not None and self.ticket is not None:
            p.tenancy.charge(self.ticket, status, usage, self.output, self.watch, now)
        if ok and link is not None:
            try:
                link.observe(pick, usage, self.ttft, now)
            except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
                log.exception("bookkeeping for worker %s failed", w.id)
            p.pool.rate_moved(w)
        return True

    def cancel(self, now: float) -> bool:
        """The carrier gave up on the attempt (the client left, the stream broke):
        its load released, nothing learned. False when it had ended already."""
        return self.end(None, None, now)

    # ------------------------------------------------------------- invariants

    def check(self) -> None:
        """Asserts the invariants of the module docstring that one ledger can see."""
        assert self.left >= 0, f"{self.left=}"
        if self.ended or self.ttft is not None:
            assert self.left == 0, f"released prefill still counted: {self.left=} {self.ended=}"
        else:
            assert self.left == self.pick.own, f"{self.left=} {self.pick.own=}"
        assert self.ended or (self.status is None and self.ok is None), "an outcome before the end"
        assert self.ended or self.quality is None, "a quality before the end"
        assert self.head is not None or self.ttfb is None, "a time to first byte without a head"
        assert self.counted or self.quality is None, "an uncounted leg's quality"

    def describe(self) -> dict[str, Any]:
        """The attempt's state, for logs and tests."""
        return {
            "worker": self.worker.id,
            "left": self.left,
            "ttft_s": self.ttft,
            "status": self.status,
            "ok": self.ok,
            "ended": self.ended,
        }
