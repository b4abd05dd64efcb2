"""The client-side deadlines: how long the router waits for a client to take its answer.

A write to a client goes into its transport's buffer; while more than
``WRITE_HIGH`` bytes of it are unsent, the writer waits for the client. Each such
wait lasts at most ``client_idle_s()`` (``timeouts.client_idle_s``: the client took
none of what is buffered for that long) and never past the request's total deadline
(``timeouts.total_s``, from when its exchange began). Past either the connection is
reset (its unsent bytes discarded, in the kernel too), the drop logged at most every
10 s and counted (``on_dropped(reason)``: ``idle`` | ``deadline``), and the writer
gets ``ClientDropped``: to the data plane, a client gone (its slot freed, its
upstream request closed, which cancels it on the worker; never a worker failure).

Both listeners use one ``SlowClients``: the raw front (``radixfleet.server.front``, which waits
on its own drain future) and the aiohttp side (the admin listener, an embedded
app: ``radixfleet.server.app``'s exchange, which bounds each of aiohttp's writes with
``bounded``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from radixfleet.server.intake import Throttled

log = logging.getLogger("radixfleet.front")

#: bytes unsent to a client past which its writer waits (both listeners' transports)
WRITE_HIGH = 64 * 1024
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection

T = TypeVar("T")


class ClientDropped(ConnectionResetError):
    """The client took nothing of its answer for ``client_idle_s()``, or the request's
    total deadline passed while it did not: its connection was reset. A
    ``ConnectionResetError``: to the handler, a client gone."""


class SlowClients:
    """The deadlines of the waits for a client (module docstring). ``client_idle_s``
    and ``total_s`` are callables read at each wait (a reload may change them);
    ``on_dropped(reason)`` counts a drop."""

    __slots__ = ("client_idle_s", "total_s", "on_dropped", "_log")

    def __init__(
        self,
        client_idle_s: Callable[[], float] = lambda: 15.0,
        total_s: Callable[[], float] = lambda: 3600.0,
        on_dropped: Callable[[str], None] | None = None,
    ) -> None:
        self.client_idle_s = client_idle_s
        self.total_s = total_s
        self.on_dropped = on_dropped
        self._log = Throttled(logger=log)

    def wait(self, deadline: float, now: float) -> tuple[float, str]:
        """How long a wait starting at ``now`` (monotonic) may last before its client is
        dropped, and why it would be: ``idle`` or ``deadline``."""
        idle_s = self.client_idle_s()
        left = deadline - now
        return (idle_s, "idle") if idle_s <= left else (max(left, 0.0), "deadline")

    def dropped(self, transport: asyncio.BaseTransport, reason: str) -> ClientDropped:
        """Logs (throttled) and counts the drop of ``transport``'s client; returns the
        exception for its writer. The caller then ``reset``s the transport."""
        peer = transport.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
        if self.on_dropped is not None:
            self.on_dropped(reason)
        if reason == "idle":
            idle_s = self.client_idle_s()
            self._log.warning(
                "client %s took none of its answer for %gs (timeouts.client_idle_s): dropped", who, idle_s
            )
            return ClientDropped(f"the client took none of its answer for {idle_s:g}s")
        self._log.warning(
            "client %s was not reading at its request's total deadline (timeouts.total_s): dropped", who
        )
        return ClientDropped("the request's total deadline passed while its client was not reading")

    async def bounded(self, write: Awaitable[T], transport: asyncio.Transport | None, deadline: float) -> T:
        """Awaits ``write`` (an aiohttp write, which waits while its buffer is full);
        if it still waits when one wait's bound (``wait``) is up, drops the client
        (its reset ends the write) and raises ``ClientDropped``. A write that waits
        for nothing is never cut, even past the deadline (as on the raw front)."""
        if transport is None:
            raise ConnectionResetError("client disconnected")
        wait_s, reason = self.wait(deadline, time.monotonic())
        dropped: list[ClientDropped] = []
        timer = asyncio.get_running_loop().call_later(wait_s, self._expire, transport, reason, dropped)
        try:
            return await write
        except ConnectionError:
            if dropped:
                raise dropped.pop() from None  # no name left holding it: no cycle
            raise
        finally:
            timer.cancel()

    def _expire(self, transport: asyncio.Transport, reason: str, dropped: list) -> None:
        if not transport.is_closing():
            dropped.append(self.dropped(transport, reason))
            reset(transport)


def reset(transport: asyncio.Transport) -> None:
    """Closes ``transport`` with a reset: its unsent bytes are discarded, in the kernel
    too (``close()`` would keep them until a client that reads nothing read them)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except OSError:
            pass
    transport.abort()
