"""JSON answers and guarded handlers: the admin listener's aiohttp endpoints
(``guarded``), and the data port's others (agent API, probes, ``/v1/models``) as
handlers of an exchange (``answered``: the raw front's, or the aiohttp app's for an
embedded router). The data plane answers through ``radixfleet.server.dataplane``'s exchanges.

Every error leaves as an OpenAI-style JSON body (``radixfleet.wire.errors``): ``guarded``
turns a ``RequestError`` raised anywhere in a handler (a bad token, a malformed
body, an unknown worker) into its status and body, so a handler states only the
success path and raises for the rest.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from radixfleet.common import jsonbody
from radixfleet.common.auth import BearerAuth
from radixfleet.config import LimitsConfig
from radixfleet.server import intake
from radixfleet.wire.errors import RequestError, retry_after_header

JSON = "application/json"
Handler = Callable[[web.Request], Awaitable[web.Response]]
#: what an exchange handler answers: (status, JSON body, extra headers as pairs)
Answer = tuple[int, Any, tuple]


def json_error(
    status: int, message: str, etype: str, code: str, param: str | None = None, headers: dict | None = None
) -> web.Response:
    """An OpenAI-style error body with ``status``."""
    body = {"error": {"message": message, "type": etype, "code": code, "param": param}}
    return web.Response(body=json.dumps(body).encode(), status=status, content_type=JSON, headers=headers)


def error_response(exc: RequestError, headers: dict | None = None) -> web.Response:
    """``exc``'s status and body, with ``Retry-After`` when it carries one."""
    h = dict(headers or {})
    if exc.retry_after_s is not None:
        h["Retry-After"] = retry_after_header(exc.retry_after_s)
    return web.Response(
        body=json.dumps(exc.to_json()).encode(), status=exc.status, content_type=JSON, headers=h
    )


def guarded(
    auth: Callable[[], BearerAuth], fn: Handler, on_hangup: Callable[[web.Request], None] | None = None
) -> Handler:
    """``fn`` behind the bearer token ``auth()`` returns at each request (a reload may
    replace it), with every ``RequestError`` answered as JSON. A peer that hangs up
    while its request is read (``ConnectionResetError``) is no server error: it goes
    to ``on_hangup`` (one counted line) and gets a 400 nobody will read, not a
    traceback."""

    async def handler(request: web.Request) -> web.Response:
        try:
            auth().check(request.headers.get("Authorization"))
            return await fn(request)
        except RequestError as exc:
            return error_response(exc)
        except ConnectionResetError:
            if on_hangup is not None:
                on_hangup(request)
            return json_error(
                400,
                "the peer closed the connection before its request was read",
                "invalid_request_error",
                "peer_hangup",
            )

    handler.__name__ = fn.__name__
    return handler


async def read_body(request: web.Request, limits: LimitsConfig) -> bytes | bytearray:
    """The body, within ``limits.max_body_bytes`` (413) and ``limits.body_timeout_s``
    (408 after it), its bytes counted in the app's ``radixfleet.server.intake.BODY_BUDGET`` while
    it is read (503 past it)."""
    budget = request.config_dict.get(intake.BODY_BUDGET)
    if budget is None:  # an app without one (tests): bounded per request only
        budget = intake.BodyBudget(limits.max_body_bytes)
    body = await intake.read_body(request, limits.max_body_bytes, limits.body_timeout_s, budget)
    budget.give(len(body))  # the callers parse it at once and let it go
    return body


async def json_body(request: web.Request, limits: LimitsConfig, *, optional: bool = False) -> Any:
    """The body as bounded JSON (``radixfleet.common.jsonbody``; ``MalformedRequest`` for anything
    else); ``{}`` for an empty body when ``optional``."""
    raw = await read_body(request, limits)
    if not raw.strip() and optional:
        return {}
    return jsonbody.loads(raw)


def reply_json(ex, status: int, body: Any, headers=()) -> None:
    """Answers ``ex`` (an exchange: ``radixfleet.server.front_exchange``) with ``body`` as JSON."""
    ex.reply(status, json.dumps(body).encode(), JSON, headers)


def reply_error(ex, exc: RequestError) -> None:
    """Answers ``ex`` with ``exc``'s status and body, its headers and ``Retry-After``."""
    headers = exc.headers
    if exc.retry_after_s is not None:
        headers = (*headers, ("Retry-After", retry_after_header(exc.retry_after_s)))
    reply_json(ex, exc.status, exc.to_json(), headers)


def answered(
    fn: Callable[[Any, bytes | bytearray], Awaitable[Answer]],
    limits: Callable[[], LimitsConfig],
    on_error: Callable[[RequestError], None] | None = None,
) -> Callable[[Any], Awaitable[None]]:
    """An exchange handler: ``fn(exchange, body)``'s answer as JSON, the body within
    ``limits().max_body_bytes`` (413); every ``RequestError`` (a refusal of its head,
    a bad body) answered as its JSON error, and given to ``on_error`` (a count)."""

    async def handler(ex) -> None:
        try:
            status, body, headers = await fn(ex, await ex.body(limits().max_body_bytes))
        except RequestError as exc:
            if on_error is not None:
                on_error(exc)
            reply_error(ex, exc)
            return
        reply_json(ex, status, body, headers)

    handler.__name__ = fn.__name__
    return handler
