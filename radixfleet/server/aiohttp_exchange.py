"""The data plane's exchange (see ``radixfleet.server.dataplane``) over an aiohttp request: the
whole API on one aiohttp app (``Router.app``: embedding, tests, ``radixfleet
gateway``'s router), where the data port's raw front (``radixfleet.server.front_exchange``) is
not the server.
"""

from __future__ import annotations

import time

from aiohttp import web

from radixfleet.server.slow_clients import WRITE_HIGH, SlowClients
from radixfleet.wire.errors import PayloadTooLarge


class AiohttpExchange:
    """The data plane's exchange over an aiohttp request (see ``Router.serve``)."""

    __slots__ = ("request", "headers", "result")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers = request.headers  # case-insensitive
        self.result: web.StreamResponse | None = None

    async def body(self, limit: int) -> bytes | bytearray:
        request = self.request
        cl = request.content_length
        if cl is not None:
            if cl > limit:
                raise PayloadTooLarge(f"request body of {cl} bytes exceeds the limit of {limit} bytes")
            return await request.read()
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return buf  # the one buffer, not a copy

    def reply(self, status: int, body: bytes, content_type: str, extra) -> None:
        h = {"Content-Type": content_type}
        h.update(extra)
        self.result = web.Response(body=body, status=status, headers=h)

    async def stream_start(self, content_type: str, extra) -> None:
        h = {"Content-Type": content_type}
        h.update(extra)
        sr = self.result = web.StreamResponse(status=200, headers=h)
        await sr.prepare(self.request)

    async def stream_write(self, data: bytes) -> None:
        sr = self.result
        assert isinstance(sr, web.StreamResponse), "stream_write before stream_start"
        await sr.write(data)

    async def stream_end(self) -> None:
        sr = self.result
        assert isinstance(sr, web.StreamResponse), "stream_end before stream_start"
        await sr.write_eof()


class ReadExchange(AiohttpExchange):
    """An ``AiohttpExchange`` whose body was read already (``Router._dataplane_route``),
    written within the client-side deadlines (``radixfleet.server.slow_clients``): each wait of
    a write for its client is bounded; a reply is written by ``sent`` in pieces, not
    left to aiohttp (whose waits for a client have no bound)."""

    __slots__ = ("_raw", "_slow", "_deadline")

    def __init__(self, request: web.Request, raw: bytes | bytearray, slow: SlowClients) -> None:
        super().__init__(request)
        self._raw = raw
        self._slow = slow
        self._deadline = time.monotonic() + slow.total_s()  # waits for the client included

    def _bounded(self, write):
        return self._slow.bounded(write, self.request.transport, self._deadline)

    def peer(self) -> tuple[str | None, tuple | None]:
        """(the client's IP address, the listener's sockname); None where unknown."""
        t = self.request.transport
        return self.request.remote, (t.get_extra_info("sockname") if t is not None else None)

    async def stream_start(self, content_type: str, extra) -> None:
        await self._bounded(super().stream_start(content_type, extra))

    async def stream_write(self, data: bytes) -> None:
        await self._bounded(super().stream_write(data))

    async def stream_end(self) -> None:
        await self._bounded(super().stream_end())

    async def sent(self) -> web.StreamResponse:
        """The answer, sent: a stream already is; a reply is written here, in pieces of
        ``WRITE_HIGH`` bytes, each wait for the client bounded (past it the client is
        dropped, and what is returned is not written again)."""
        r = self.result
        assert r is not None, "serve answers every request"
        if r.prepared:
            return r
        assert isinstance(r, web.Response), "an unsent answer is a reply"
        body = memoryview(r.body if isinstance(r.body, (bytes, bytearray)) else b"")
        sr = self.result = web.StreamResponse(status=r.status, headers=r.headers)
        sr.content_length = len(body)
        try:
            await self._bounded(sr.prepare(self.request))
            for i in range(0, len(body), WRITE_HIGH):
                await self._bounded(sr.write(body[i : i + WRITE_HIGH]))
            await self._bounded(sr.write_eof())
        except ConnectionResetError:
            pass  # the client left or was dropped: aiohttp's own last write fails quietly
        return sr

    async def body(self, limit: int) -> bytes | bytearray:
        if len(self._raw) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return self._raw
