"""What a client may hold of the router before its request is admitted.

A client's bytes cost memory and its connections cost descriptors before any
admission slot is taken, so both are bounded here, for every listener (the
raw front of the data port, ``radixfleet.server.front``, and the admin listener's aiohttp app):

- ``BodyBudget``: request body bytes held, all connections together, from the first
  byte received until the request is answered. A body that would take it past its
  limit is refused (``BodyBudgetFull``: 429 + Retry-After) and its bytes dropped, so
  the bodies held never exceed ``limits.max_buffered_body_bytes``.
- ``raise_fd_limit`` / ``connection_cap``: the soft RLIMIT_NOFILE raised to the hard
  limit at start, and the client-connection cap kept below it (half the descriptors
  stay for upstream connections, files and the event loop), so the listener refuses
  with an answer rather than failing ``accept()`` with EMFILE and resetting clients.
- ``Throttled``: a log line at most once per interval, with the count of the ones
  it stood for (a refusal per connection must not flood the log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from radixfleet.wire.errors import Overloaded, PayloadTooLarge, RequestTimeout

if TYPE_CHECKING:
    from radixfleet.config import LimitsConfig

log = logging.getLogger("radixfleet.intake")

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None  # type: ignore[assignment]  # the optional-module idiom; raise_fd_limit tests it


class BodyBudgetFull(Overloaded):
    """The router holds as many request body bytes as it may: try again shortly."""

    code = "body_budget_exhausted"


class BodyBudget:
    """Request body bytes held at once, all connections together.

    Invariant: 0 <= held <= limit (a reload may lower ``limit`` below ``held``; takes
    then fail until enough is given back). Whoever ``take``s n bytes gives back
    exactly n, once, on every path (answered, refused, connection lost)."""

    __slots__ = ("limit", "held", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes (``configure`` on reload)
        self.held = 0  # bytes taken and not given back
        self.refused = 0  # takes refused since start (a metric)

    def configure(self, limits: LimitsConfig) -> None:
        """Takes a reloaded ``limits`` section: its ``max_buffered_body_bytes`` (below
        ``held``: takes fail until enough is given back)."""
        self.limit = limits.max_buffered_body_bytes

    def take(self, n: int) -> bool:
        """Takes ``n`` bytes if they fit; False (nothing taken) if not. O(1)."""
        if self.held + n > self.limit:
            self.refused += 1
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n
        assert self.held >= 0, f"{self.held=} after giving back {n}"

    def full(self) -> BodyBudgetFull:
        """The error a refused body gets."""
        return BodyBudgetFull(
            f"the router holds {self.limit} bytes of request bodies already; retry shortly", retry_after_s=1
        )

    def check(self) -> None:
        assert self.held >= 0, f"{self.held=}"


class Throttled:
    """``logger.warning`` at most once per ``interval_s`` (``logger``: this module's
    by default); the lines skipped in between are counted into the next one."""

    __slots__ = ("interval_s", "_next", "_skipped", "_log")

    def __init__(self, interval_s: float = 10.0, logger: logging.Logger | None = None) -> None:
        self.interval_s = interval_s
        self._next = 0.0
        self._skipped = 0
        self._log = log if logger is None else logger  # this module's, unless given

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        self._next = now + self.interval_s
        skipped, self._skipped = self._skipped, 0
        if skipped:
            self._log.warning(msg + " (and %d more like it since the last report)", *args, skipped)
        else:
            self._log.warning(msg, *args)


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (a process may, unprivileged);
    returns the soft limit now in force (0 where there is none to read)."""
    if resource is None:
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard or hard == resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. a hard limit above the kernel's
            log.warning("could not raise the open-file limit from %d to %s: %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(configured: int, fd_limit: int) -> int:
    """The client-connection cap: ``configured``, but at most half the descriptors
    the process may open (less 64 for its own files), at least 16."""
    if fd_limit <= 0:
        return configured
    return min(configured, max(16, (fd_limit - 64) // 2))


#: the app's BodyBudget, for handlers that read bodies through aiohttp
BODY_BUDGET: web.AppKey[BodyBudget] = web.AppKey("radixfleet_body_budget", BodyBudget)


async def read_body(
    request: web.Request, limit: int, timeout_s: float, budget: BodyBudget
) -> bytes | bytearray:
    """An aiohttp request's body: at most ``limit`` bytes (``PayloadTooLarge``), all of
    it within ``timeout_s`` (``RequestTimeout``), its bytes taken from ``budget`` as
    they arrive (``BodyBudgetFull``). On success the caller holds ``len(body)`` bytes
    of ``budget`` and gives them back when done with the body; on error nothing is
    held. The body is held once, in one buffer: its first piece as received, then a
    bytearray the later pieces are appended to (chunks joined at the end were held
    twice at the join)."""
    cl = request.content_length
    if cl is not None and cl > limit:
        raise PayloadTooLarge(f"request body of {cl} bytes exceeds the limit of {limit} bytes")
    body: bytes | bytearray = b""
    held = 0

    async def read() -> None:
        nonlocal held, body
        async for chunk in request.content.iter_any():
            n = len(chunk)
            if held + n > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if not budget.take(n):
                raise budget.full()
            held += n
            if not body:
                body = chunk
            elif type(body) is bytes:
                body = bytearray(body) + chunk
            else:
                body += chunk

    try:
        await asyncio.wait_for(read(), timeout_s)  # (asyncio.timeout: Python 3.11+)
    except asyncio.TimeoutError:
        budget.give(held)
        raise RequestTimeout(f"request body not received within {timeout_s:g}s") from None
    except BaseException:
        budget.give(held)
        raise
    return body
