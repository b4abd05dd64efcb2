"""The router's mark on every request it sends a worker, so that one coming back is refused.

Registration refuses a worker URL that leads to the router's own listeners
(``radixfleet.fleet.registration``), but it cannot see every way back: a NAT, port forward or
load balancer in front of the router, a name re-pointed after it was checked, a
configured or admin-added worker at the router's address, two routers registered at
each other. Without a mark each such request recursed until every admission slot
and queue place was taken (1,024 nested hops for one client request). With it::

    x-radixfleet-hop: <mark>[, <mark>...]     the marks of the routers it went
                                              through, oldest first

    sent          every request to a worker: the data plane's tries and both legs
                  of a disaggregated request, and GET /v1/models asked for a
                  client's, carry the marks they arrived with plus this router's;
                  everything else the router asks of workers on its own (warm-ups,
                  prefetch fills, health checks, /v1/models, engine probes: the
                  client session's default header) carries this router's alone
    on arrival    at a data-plane path (from the head, before its body is read or
                  an admission slot taken) and at GET /v1/models, which asks every
                  worker's own (``check``): a mark equal to this
                  router's, or more than MAX_HOPS marks (a loop through routers
                  that each see it once), is 508 loop_detected; a value that is
                  not marks is 400

A mark is 16 random hex digits per router process, so a client cannot name one it
has not seen; one that sends its own marks only refuses its own requests. The
router that sent the looping request sees the 508 as its worker's failure (a 502 to
its client, its breaker counting it), so a loop costs two hops per client request
until that worker's breaker opens.
"""

from __future__ import annotations

import re
import secrets

from radixfleet.wire.errors import LoopDetected, MalformedRequest

HOP_HEADER = "x-radixfleet-hop"
#: marks a request may carry on arrival; a longer chain is a loop
MAX_HOPS = 8

_MARKS = re.compile(r"[0-9a-f]{16}(?:[ \t]*,[ \t]*[0-9a-f]{16})*")


class Hops:
    """This router's mark (``mark``, fixed for the object's life) and the hop header
    of what it sends. Stateless otherwise; one per data plane."""

    __slots__ = ("mark", "_line", "_own")

    def __init__(self, mark: str | None = None) -> None:
        self.mark = mark or secrets.token_hex(8)
        assert _MARKS.fullmatch(self.mark), f"{self.mark=} is not 16 hex digits"
        self._line = f"{HOP_HEADER}: {self.mark}\r\n".encode()
        self._own = {HOP_HEADER: self.mark}

    def check(self, headers) -> None:
        """Raises ``LoopDetected`` for a request that carries this router's mark or
        more than ``MAX_HOPS`` marks, ``MalformedRequest`` for a hop header that is
        not marks. ``headers``: a mapping, lower-case names or case-insensitive."""
        value = headers.get(HOP_HEADER)
        if value is None:
            return
        value = value.strip()
        if len(value) > 2048 or not _MARKS.fullmatch(value):
            raise MalformedRequest(
                f"'{HOP_HEADER}' is set by radixfleet routers only: comma-separated marks of 16 hex digits"
            )
        marks = [m.strip() for m in value.split(",")]
        if self.mark in marks:
            raise LoopDetected(
                "this request came back to the router that sent it: a worker's URL "
                "leads to a router (see the router's log for the worker)"
            )
        if len(marks) > MAX_HOPS:
            raise LoopDetected(f"this request went through {len(marks)} routers; at most {MAX_HOPS}")

    def lines(self, headers) -> bytes:
        """The hop header line (CRLF-terminated) of a request forwarded for one that
        arrived with ``headers`` (``check`` passed): its marks, then this router's."""
        came = headers.get(HOP_HEADER)
        if not came:
            return self._line
        return f"{HOP_HEADER}: {came.strip()}, {self.mark}\r\n".encode()

    def headers(self, came=None) -> dict[str, str]:
        """The hop header as a mapping: of a request this router makes itself (``came``
        None: a warm-up, a health check, the client session's default), or of one
        made for a request that arrived with headers ``came`` (``check`` passed)."""
        prior = came.get(HOP_HEADER) if came is not None else None
        return {HOP_HEADER: f"{prior.strip()}, {self.mark}"} if prior else self._own
