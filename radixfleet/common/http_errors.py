"""aiohttp's connection protocol with JSON answers to malformed HTTP.

aiohttp answers bytes it cannot parse as HTTP (a bad chunk size, a header line
over 8 KB, a bad method) from ``RequestHandler.handle_error``: a plain-text
``HTTP/1.0 400`` body, and an ERROR log record with the parser's traceback — per
request, for something any client can send. ``JsonErrorHandler`` answers those
with the OpenAI-style JSON error body every other error of ours has, and logs one
DEBUG line without a traceback (``on_bad_http`` counts them); a genuine 500 (a bug
in a handler) keeps aiohttp's ERROR record and traceback.

The router's admin listener and the agent listen with ``await listen(runner,
host, port)``. Both build the same
``RequestHandler`` aiohttp would, with its public constructor.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("radixfleet.http")


def _code(status: int) -> str:
    return {
        400: "bad_http",
        408: "request_timeout",
        413: "payload_too_large",
        431: "request_header_fields_too_large",
    }.get(status, "bad_http")


class JsonErrorHandler(web.RequestHandler):
    """``web.RequestHandler`` whose protocol-level errors are JSON (see module)."""

    #: called with the status of every malformed request answered (a metric)
    on_bad_http: Callable[[int], None] | None = None

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text = "internal server error"
            etype, code = "server_error", "internal_error"
        else:
            text = " ".join(
                str(message or getattr(exc, "message", "") or exc or "malformed HTTP request").split()
            )[:300]
            log.debug("malformed HTTP request (%d): %s", status, text)
            if self.on_bad_http is not None:
                self.on_bad_http(status)
            if request.writer.output_size > 0:
                raise ConnectionError("response already started; cannot answer the error")
            etype, code = "invalid_request_error", _code(status)
        body = {"error": {"message": text, "type": etype, "code": code, "param": None}}
        resp = web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            # a request body that broke off mid-way (bad chunk framing, short body),
            # met while aiohttp drained it after the handler: the client's doing
            log.debug("malformed HTTP request body: %s", " ".join(str(exc).split())[:300])
            if self.on_bad_http is not None:
                self.on_bad_http(400)
            return
        super().log_exception(*args, **kw)


def factory(
    runner: web.AppRunner, *, on_bad_http: Callable[[int], None] | None = None, **kwargs: Any
) -> Callable[[], web.RequestHandler]:
    """A protocol factory for ``runner``'s app (after ``await runner.setup()``):
    what ``runner.server`` would build, as a ``JsonErrorHandler``. ``kwargs`` are
    ``RequestHandler`` options (``access_log=None``, ...)."""
    server = runner.server
    if server is None:
        raise RuntimeError("call await runner.setup() before http_errors.factory()")
    loop = asyncio.get_running_loop()
    cls: type[JsonErrorHandler] = JsonErrorHandler
    if on_bad_http is not None:
        cls = type(
            "CountingJsonErrorHandler", (JsonErrorHandler,), {"on_bad_http": staticmethod(on_bad_http)}
        )
    return lambda: cls(server, loop=loop, **kwargs)


async def listen(runner: web.AppRunner, host: str, port: int, **kwargs: Any) -> asyncio.Server:
    """Listens on ``host:port`` with ``factory(runner, **kwargs)`` (aiohttp's
    ``TCPSite``, with JSON errors). The caller closes the returned server before
    ``runner.cleanup()``."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(factory(runner, **kwargs), host, port, reuse_address=True, backlog=1024)
