"""The router's aiohttp application: data plane, admin API, agent API, metrics.

Per data-plane request (``Router._proxy``), in this order and with nothing awaited
between the pick and the load count::

    admission (concurrency slot or bounded queue, else 429 + Retry-After)
    read body (<= limits.max_body_bytes, else 413) -> json (else 400)
    tenant = TenantResolver(headers)                 (auth.py; 401 if a key is required)
    key    = request_key(endpoint, body, tenant, block_bytes)   (400 naming the field)
    views  = pool.views(now)                         (routable only; none -> 503)
    router.pick.pick_worker (the simulator calls it too):
      match  = index.match(key.hashes, now)
      d      = policy.choose(RouteRequest, match, views, now)
      index.insert(d.worker, key.hashes, now)         optimistic hint
      pool.pick(worker, uncached prompt tokens)       load counted at pick time
    warm-ups of a hot root's new replica (router.warmup.WarmupGate)
    forward raw body bytes (x-radixfleet-tenant, x-request-id) -> worker
        connect error / 5xx / timeout before the client saw a byte: retry on another
        worker (retries.max_attempts, exponential backoff)
        streaming: SSE bytes pass through as they arrive; a failure after the first
        byte ends the stream with an SSE error event and ``data: [DONE]``
    pool.finish(worker)                               on every path (client gone too)

Endpoints::

    POST /v1/completions, /v1/chat/completions, /generate      data plane
    GET  /v1/models            union of the routable workers' models
    GET  /health               the router process is up
    GET  /readiness            200 once at least one worker is healthy, else 503
    GET  /metrics              Prometheus text
    GET/POST /admin/workers, DELETE /admin/workers/{id}, POST /admin/workers/{id}/drain
    GET  /admin/index          index stats, hot prefixes, policy.describe()
    POST /admin/reload         re-read the config file (400 with the message if invalid)
    POST /internal/v1/register, /internal/v1/events            agents (router.events)

Listening (``RouterServer``): the raw HTTP/1.1 front of ``router.proxy`` serves the
three data-plane POST paths itself (parsed by httptools) and hands any other
request, with its connection, to this aiohttp app on the same port — aiohttp's
request machinery cost about as much as the whole rest of a proxied request. The
same ``Router.serve`` also runs behind the aiohttp app's own data-plane routes
(``AiohttpExchange``), for embedding and tests.

Every error is an OpenAI-style JSON body (``router.errors``); bad input is never a
500. Lifecycle: the client session, health checks, the reload watcher and warm-up
tasks live in ``cleanup_ctx``; ``aclose()`` of the pool runs there.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from policies.base import Reason, RouteRequest
from router import events as ev
from router.auth import BearerAuth, TenantResolver, check_exposure
from router.config import (
    MISSING, Config, WorkerSpec, build_policy_from, default_worker_id, load_config,
    parse_worker_url, with_overrides, parse_section,
)
from router.errors import (
    ConfigError, MalformedRequest, NoWorkerAvailable, NotFound, Overloaded, PayloadTooLarge,
    RequestError,
)
from router.feedback import Feedback
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from router.pick import pick_worker
from router.pool import Pool, Source
from router.prefix_index import PrefixIndex
from router.prefix_keys import Endpoint, request_key
from router.proxy import UpstreamError, UpstreamPool, build_head
from router.warmup import WarmupGate, warmup_prefix

log = logging.getLogger("radixfleet.router")

TENANT_HEADER = "x-radixfleet-tenant"
WORKER_HEADER = "x-radixfleet-worker"
REQUEST_ID_HEADER = "x-request-id"

_JSON = "application/json"
_DONE = b"data: [DONE]\n\n"


def json_error(status: int, message: str, etype: str, code: str,
               param: str | None = None, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "code": code, "param": param}}
    return web.Response(body=json.dumps(body).encode(), status=status, content_type=_JSON,
                        headers=headers)


def error_response(exc: RequestError, headers: dict | None = None) -> web.Response:
    h = dict(headers or {})
    if isinstance(exc, Overloaded):
        h["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return web.Response(body=json.dumps(exc.to_json()).encode(), status=exc.status,
                        content_type=_JSON, headers=h)


class Admission:
    """A concurrency limit with a bounded FIFO queue.

    ``active`` counts requests holding a slot (<= limit, except briefly after a
    reload lowers the limit); ``_waiters`` holds futures of queued requests. A
    released slot passes directly to the oldest live waiter, so ``active`` is
    unchanged by the hand-over.
    """

    __slots__ = ("limit", "max_queue", "timeout_s", "retry_after_s", "active", "_waiters")

    def __init__(self, limit: int, max_queue: int, timeout_s: float, retry_after_s: int) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_enter(self) -> bool:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        """Waits for a slot. Raises ``Overloaded`` if the queue is full or the wait
        times out; on cancellation nothing is held."""
        if self.try_enter():
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(f"router at capacity ({self.limit} in flight, "
                             f"{len(self._waiters)} queued)", retry_after_s=self.retry_after_s)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.leave()  # the slot arrived as we gave up: pass it on
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded(f"no slot within {self.timeout_s:g}s",
                             retry_after_s=self.retry_after_s) from None

    def leave(self) -> None:
        w = self._waiters
        while w:
            f = w.popleft()
            if not f.done():
                if self.active <= self.limit:
                    f.set_result(None)
                    return
                w.appendleft(f)
                break
        self.active -= 1

    def check(self) -> None:
        assert self.active >= 0, f"{self.active=}"


class _UpstreamFailed(Exception):
    """One attempt failed before the client saw a byte (retryable)."""

    def __init__(self, cause: str, detail: str, status: int | None = None,
                 body: bytes | None = None, headers: Any = None) -> None:
        super().__init__(detail)
        self.cause = cause  # connect | status | timeout | payload
        self.status = status
        self.body = body
        self.headers = headers


class AiohttpExchange:
    """The data plane's exchange over an aiohttp request (see ``Router.serve``)."""

    __slots__ = ("request", "headers", "result")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers = request.headers  # case-insensitive
        self.result: web.StreamResponse | None = None

    async def body(self, limit: int) -> bytes:
        request = self.request
        cl = request.content_length
        if cl is not None:
            if cl > limit:
                raise PayloadTooLarge(f"request body of {cl} bytes exceeds the limit of "
                                      f"{limit} bytes")
            return await request.read()
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return bytes(buf)

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
        await self.result.write(data)

    async def stream_end(self) -> None:
        await self.result.write_eof()




class Router:
    """The router service: index, pool, policy, metrics, and the request logic.

    ``Router(cfg).app`` is the aiohttp application (admin, agents, probes, and the
    data plane through ``AiohttpExchange``); ``RouterServer(router)`` listens with
    the raw front for the data plane. ``overrides`` (``section__key`` names,
    ``MISSING`` = absent) are reapplied on every reload so command-line options keep
    winning over the file.
    """

    def __init__(self, cfg: Config, *, overrides: dict[str, Any] | None = None) -> None:
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not MISSING}
        self.cfg = cfg
        self.metrics = Metrics()
        self.index = PrefixIndex(cfg.index.max_bytes, cfg.index.half_life_s)
        self.policy = build_policy_from(cfg.policy)
        self.admin_auth = BearerAuth(cfg.auth.admin_token_env, "admin")
        self.agent_auth = BearerAuth(cfg.auth.agent_token_env, "agent")
        check_exposure(cfg, self.admin_auth, self.agent_auth)
        self.tenants = TenantResolver(cfg.keys.tenant)
        self.pool = Pool(cfg, self.index)
        self.feedback = Feedback(self.pool, self.index, self.metrics, cfg.keys.block_bytes)
        lim = cfg.limits
        self.admission = Admission(lim.max_concurrency, lim.max_queue, lim.queue_timeout_s,
                                   lim.retry_after_s)
        self.session: aiohttp.ClientSession | None = None  # health checks, models, warm-ups
        self.upstream: UpstreamPool | None = None  # the data plane's connections
        self._addrs: dict[str, tuple[str, int, str]] = {}
        self._rid_prefix = os.urandom(4).hex()
        self._rid = itertools.count(1)
        self._warmed = WarmupGate()  # hot-root warm-ups sent (router.warmup)
        self._tasks: set[asyncio.Task] = set()
        self._models_cache: tuple[float, dict] | None = None
        self._mtime = self._file_mtime()
        self._reload_lock = asyncio.Lock()
        self.app = self._build_app()

    # ------------------------------------------------------------------ setup

    def _build_app(self) -> web.Application:
        # Body size is enforced by the exchanges (a reload may change it).
        app = web.Application(client_max_size=2**62)
        r = app.router
        for e in Endpoint:
            r.add_post(e.value, self._make_handler(e))
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/readiness", self._readiness)
        r.add_get("/metrics", self._metrics)
        r.add_get("/admin/workers", self._admin(self._list_workers))
        r.add_post("/admin/workers", self._admin(self._add_worker))
        r.add_delete("/admin/workers/{id}", self._admin(self._remove_worker))
        r.add_post("/admin/workers/{id}/drain", self._admin(self._drain_worker))
        r.add_get("/admin/index", self._admin(self._index_info))
        r.add_post("/admin/reload", self._admin(self._reload_handler))
        r.add_post(ev.REGISTER_PATH, self._agent(self._register))
        r.add_post(ev.EVENTS_PATH, self._agent(self._events))
        self._known = {}
        for res in r.resources():
            info = res.get_info()
            path = info.get("path") or info.get("formatter")
            self._known.setdefault(path, set()).update(rt.method for rt in res)
        r.add_route("*", "/{tail:.*}", self._not_found)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application):
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=conn, auto_decompress=False, skip_auto_headers=("User-Agent",))
        self.upstream = UpstreamPool(connect_timeout_s=self.cfg.timeouts.connect_s)
        try:
            await self.pool.start(self.session)
            if self.cfg.path and self.cfg.reload.watch:
                self._spawn(self._watch_config())
            yield
        finally:
            await self.pool.aclose()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.upstream.aclose()
            await self.session.close()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def aclose(self) -> None:
        """Stops background work (the app's cleanup does this too). Idempotent."""
        await self.pool.aclose()

    # ------------------------------------------------------------- data plane
    #
    # The data plane is written against an *exchange* (one request/response): the
    # raw HTTP/1.1 front (router.proxy.FrontServer, what ``radixfleet router``
    # listens with) and the aiohttp app (``AiohttpExchange``; tests and embedding)
    # both provide one. An exchange has ``headers`` (lower-case names),
    # ``await body(limit)``, ``reply(status, body, content_type, extra)``,
    # ``await stream_start(content_type, extra)``, ``await stream_write(data)``,
    # ``await stream_end()`` and ``result`` (what an aiohttp handler returns).

    def _make_handler(self, endpoint: Endpoint):
        async def handler(request: web.Request) -> web.StreamResponse:
            ex = AiohttpExchange(request)
            await self.serve(ex, endpoint)
            return ex.result
        handler.__name__ = f"proxy_{endpoint.name.lower()}"
        return handler

    def _reject(self, ex, exc: RequestError, rid: str) -> None:
        self.metrics.rejected.labels(str(exc.status), exc.code).inc()
        extra = [(REQUEST_ID_HEADER, rid)]
        if isinstance(exc, Overloaded):
            extra.append(("Retry-After", str(max(1, round(exc.retry_after_s)))))
        ex.reply(exc.status, json.dumps(exc.to_json()).encode(), _JSON, extra)

    async def _read_body(self, request: web.Request) -> bytes:
        """The body of an aiohttp request, within ``limits.max_body_bytes``."""
        return await AiohttpExchange(request).body(self.cfg.limits.max_body_bytes)

    async def serve(self, ex, endpoint: Endpoint) -> None:
        """Serves one data-plane request on exchange ``ex``. Never raises for bad
        input (it becomes a JSON error reply); cancellation (client gone) propagates
        after every resource is released."""
        t0 = time.monotonic()
        headers = ex.headers
        rid = headers.get(REQUEST_ID_HEADER) or f"{self._rid_prefix}-{next(self._rid)}"
        adm = self.admission
        if not adm.try_enter():
            try:
                await adm.enter()
            except Overloaded as exc:
                self._reject(ex, exc, rid)
                return
        try:
            try:
                raw = await ex.body(self.cfg.limits.max_body_bytes)
                try:
                    body = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise MalformedRequest(f"request body is not valid UTF-8: {exc.reason} "
                                           f"at byte {exc.start}") from None
                except ValueError as exc:
                    raise MalformedRequest(f"request body is not valid JSON: {exc}") from None
                tenant = self.tenants.tenant(headers)
                key = request_key(endpoint, body, tenant=tenant,
                                  block_bytes=self.cfg.keys.block_bytes)
                stream = body.get("stream", False)
                if stream is not True and stream is not False:
                    raise MalformedRequest("'stream' must be a boolean", param="stream")
                session = headers.get("x-session-id")
                if session is None:
                    user = body.get("user")
                    session = user if isinstance(user, str) else None
            except RequestError as exc:
                self._reject(ex, exc, rid)
                return
            await self._route_and_forward(ex, endpoint, raw, body, key, stream, session,
                                          rid, t0)
        finally:
            adm.leave()

    async def _route_and_forward(self, ex, endpoint, raw, body, key, stream, session,
                                 rid, t0) -> None:
        pool = self.pool
        now = time.monotonic()
        views = pool.views(now)
        if not views:
            self._reject(ex, NoWorkerAvailable(
                f"no healthy worker available ({len(pool)} known)"), rid)
            return
        index = self.index
        req = RouteRequest(key.hashes, key.prompt_tokens, key.block_tokens, session,
                           key.model, len(key.data))
        # match, choose, hint, count the uncached tokens: router.pick (the simulator's too)
        d, w, tokens, depth = pick_worker(self.policy, index, pool, req, views, now)
        if d.warm and self.cfg.warmup.enabled:
            self._schedule_warmups(d.warm, endpoint, body, key, depth, now)
        fwd = (b"x-radixfleet-tenant: " + key.tenant.encode("utf-8", "surrogateescape")
               + b"\r\nx-request-id: " + rid.encode("utf-8", "surrogateescape") + b"\r\n")
        reason = d.reason.value
        tried: list[str] = []
        retries = self.cfg.retries
        attempt = 0
        last: _UpstreamFailed | None = None
        while True:
            attempt += 1
            tried.append(w.id)
            try:
                await self._attempt(ex, w, endpoint, raw, fwd, stream, tokens, rid, reason, t0)
                return
            except _UpstreamFailed as exc:
                last = exc
                self.metrics.request_done(w.id, exc.status or 502, reason)
                log.info("request %s: worker %s failed (%s: %s), attempt %d/%d", rid, w.id,
                         exc.cause, exc, attempt, retries.max_attempts)
            if attempt >= retries.max_attempts or \
                    time.monotonic() - t0 >= self.cfg.timeouts.total_s:
                break
            delay = min(retries.backoff_s * (2 ** (attempt - 1)), retries.backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            now = time.monotonic()
            views = [v for v in pool.views(now) if v.id not in tried]
            if not views:
                break
            d, w, tokens, _ = pick_worker(self.policy, index, pool, req, views, now, count=False)
            reason = Reason.FALLBACK.value
            self.metrics.retries.labels(last.cause).inc()
        # Every attempt failed before the client saw anything.
        if last.status is not None and last.body is not None:
            # the last worker's own error answer, passed through
            ex.reply(last.status, last.body, last.headers.get("content-type", _JSON),
                     [(WORKER_HEADER, tried[-1]), (REQUEST_ID_HEADER, rid)])
            return
        status, code = ((504, "upstream_timeout") if last.cause == "timeout"
                        else (502, "bad_gateway"))
        self.metrics.rejected.labels(str(status), code).inc()
        err = {"error": {"message": f"{len(tried)} attempt(s) failed (workers "
                         f"{', '.join(tried)}); last: {last}", "type": "upstream_error",
                         "code": code, "param": None}}
        ex.reply(status, json.dumps(err).encode(), _JSON, [(REQUEST_ID_HEADER, rid)])

    async def _attempt(self, ex, w, endpoint, raw, fwd, stream, tokens, rid, reason,
                       t0) -> None:
        """One try on worker ``w`` (its load already counted). Releases the load on
        every path. Raises ``_UpstreamFailed`` if it failed before the client saw a
        byte; after that, failures end the stream with an SSE error event."""
        pool = self.pool
        m = self.metrics
        left = tokens  # tokens still counted on w
        ok: bool | None = None
        host, port, hostport = self._addr(w.url)
        t = self.cfg.timeouts
        head = build_head(endpoint.value, hostport, len(raw), fwd)
        resp = None
        try:
            try:
                resp = await self.upstream.request(
                    host, port, head, raw, read_timeout_s=t.first_byte_s,
                    total_timeout_s=t.total_s - (time.monotonic() - t0))
                status = resp.status
                if status >= 500:
                    body = await resp.read()
                    ok = False
                    raise _UpstreamFailed("status", f"worker {w.id} answered {status}",
                                          status, body, resp.headers)
                if not stream or status != 200:
                    data = await resp.read()
                    ok = True
                    ex.reply(status, data, resp.headers.get("content-type", _JSON),
                             [(WORKER_HEADER, w.id), (REQUEST_ID_HEADER, rid)])
                    m.request_done(w.id, status, reason)
                    m.observe_latency(time.monotonic() - t0)
                    return
                first = await resp.readany()
                pool.prefilled(w, left)
                left = 0
                m.observe_ttfb(time.monotonic() - t0)
                await ex.stream_start(resp.headers.get("content-type", "text/event-stream"),
                                      [("Cache-Control", "no-cache"), (WORKER_HEADER, w.id),
                                       (REQUEST_ID_HEADER, rid)])
                # From here on the client has bytes: never retry.
                try:
                    if first:
                        await ex.stream_write(first)
                    while True:
                        try:
                            chunk = await resp.readany()
                        except UpstreamError as exc:
                            ok = False
                            log.warning("request %s: worker %s failed mid-stream: %s", rid,
                                        w.id, exc)
                            m.request_done(w.id, 502, reason)
                            err = {"error": {"message": f"worker {w.id} failed mid-stream: "
                                             f"{exc}", "type": "upstream_error",
                                             "code": "upstream_failed", "param": None}}
                            await ex.stream_write(b"data: " + json.dumps(err).encode()
                                                  + b"\n\n" + _DONE)
                            await ex.stream_end()
                            return
                        if not chunk:
                            break
                        await ex.stream_write(chunk)
                    await ex.stream_end()
                except (ConnectionResetError, aiohttp.ClientConnectionError):
                    return  # the client went away (ok stays None: not the worker's fault)
                ok = True
                m.request_done(w.id, 200, reason)
                m.observe_latency(time.monotonic() - t0)
            except UpstreamError as exc:
                ok = False
                if exc.cause == "connect":
                    pool.check_soon(w)
                raise _UpstreamFailed(exc.cause, f"worker {w.id}: {exc}") from None
        finally:
            if resp is not None:
                resp.release()
            pool.finish(w, left, ok)

    def _addr(self, url: str) -> tuple[str, int, str]:
        a = self._addrs.get(url)
        if a is None:
            parts = urlsplit(url)
            port = parts.port or 80
            a = self._addrs[url] = (parts.hostname, port, parts.netloc)
        return a

    # -------------------------------------------------------------- warm-ups

    def _schedule_warmups(self, workers, endpoint, body, key, depth, now) -> None:
        bb = key.block_bytes
        prefix = warmup_prefix(key.hashes, depth)
        if prefix is None:
            return
        blocks, h = prefix
        prompt: Any
        p = body.get("prompt") if endpoint is Endpoint.COMPLETIONS else None
        if isinstance(p, list) and p and type(p[0]) is int:
            prompt = p[: blocks * key.block_tokens]
        else:
            try:
                prompt = key.data[: blocks * bb].decode("utf-8")
            except UnicodeDecodeError:
                log.debug("warm-up skipped: prefix cut inside a UTF-8 sequence")
                return
        interval = self.cfg.warmup.min_interval_s
        payload = None
        for wid in workers:
            w = self.pool.get(wid)
            if w is None or not self._warmed.admit(wid, h, now, interval):
                continue
            if payload is None:
                payload = json.dumps({"model": key.model, "prompt": prompt, "max_tokens": 1,
                                      "stream": False}).encode()
            self._spawn(self._warmup(w, payload, key.tenant))

    async def _warmup(self, w, payload: bytes, tenant: str) -> None:
        headers = {"Content-Type": _JSON, TENANT_HEADER: tenant,
                   REQUEST_ID_HEADER: f"{self._rid_prefix}-warm-{next(self._rid)}"}
        status = "error"
        try:
            async with self.session.post(
                w.url + Endpoint.COMPLETIONS.value, data=payload, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.warmup.timeout_s),
            ) as resp:
                await resp.read()
                status = "ok" if resp.status < 400 else "error"
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.debug("warm-up of %s failed: %r", w.id, exc)
        self.metrics.warmups.labels(status).inc()

    # ------------------------------------------------------------ small GETs

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readiness(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        healthy = [w.id for w in self.pool if w.health.value == "healthy"]
        routable = [w.id for w in self.pool.routable_workers(now)]
        body = {"ready": bool(healthy), "healthy": healthy, "routable": routable}
        return web.json_response(body, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.refresh(self.pool, self.index, time.monotonic(), self.cfg.index.hot_k)
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        cached = self._models_cache
        if cached is not None and now - cached[0] < 2.0:
            return web.json_response(cached[1])
        workers = self.pool.routable_workers(now)

        async def fetch(w):
            try:
                async with self.session.get(w.url + "/v1/models",
                                            timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                    if r.status != 200:
                        return []
                    data = json.loads(await r.read())
                    return [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError,
                    OSError):
                return [{"id": m, "object": "model", "owned_by": w.id} for m in w.models]

        seen: dict[str, dict] = {}
        for models in await asyncio.gather(*(fetch(w) for w in workers)):
            for m in models:
                seen.setdefault(m["id"], m)
        out = {"object": "list", "data": [seen[k] for k in sorted(seen)]}
        self._models_cache = (now, out)
        return web.json_response(out)

    async def _not_found(self, request: web.Request) -> web.Response:
        allowed = self._known.get(request.path)
        if allowed:
            return json_error(405, f"method {request.method} not allowed on {request.path}; "
                              f"allowed: {', '.join(sorted(allowed))}", "invalid_request_error",
                              "method_not_allowed", headers={"Allow": ", ".join(sorted(allowed))})
        exc = NotFound(f"unknown path {request.path}")
        return error_response(exc)

    # ----------------------------------------------------- admin and agent APIs

    def _admin(self, fn):
        async def handler(request: web.Request) -> web.Response:
            try:
                self.admin_auth.check(request.headers.get("Authorization"))
                return await fn(request)
            except RequestError as exc:
                return error_response(exc)
        handler.__name__ = fn.__name__
        return handler

    def _agent(self, fn):
        async def handler(request: web.Request) -> web.Response:
            try:
                self.agent_auth.check(request.headers.get("Authorization"))
                return await fn(request)
            except RequestError as exc:
                return error_response(exc)
        handler.__name__ = fn.__name__
        return handler

    async def _json_body(self, request: web.Request, *, optional: bool = False) -> Any:
        raw = await self._read_body(request)
        if not raw.strip() and optional:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise MalformedRequest(f"request body is not valid JSON: {exc}") from None

    async def _list_workers(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({"workers": [w.describe(now) for w in self.pool]})

    async def _add_worker(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        try:
            spec = parse_section(WorkerSpec, body, "worker")
            if not spec.url:
                raise ConfigError("worker.url", "required: the worker's base URL")
            url = parse_worker_url(spec.url, "worker.url")
        except ConfigError as exc:
            raise MalformedRequest(str(exc)) from None
        wid = spec.id or default_worker_id(url)
        try:
            w = self.pool.add(wid, url, Source.ADMIN, spec.weight, spec.prefill_tokens_per_s)
        except ValueError as exc:
            return json_error(409, str(exc), "invalid_request_error", "conflict")
        return web.json_response({"status": "ok", "worker": w.describe(time.monotonic())},
                                 status=201)

    def _worker_or_404(self, request: web.Request):
        wid = request.match_info["id"]
        w = self.pool.get(wid)
        if w is None:
            raise NotFound(f"unknown worker {wid!r}")
        return w

    async def _remove_worker(self, request: web.Request) -> web.Response:
        w = self._worker_or_404(request)
        self.pool.remove(w.id)
        return web.json_response({"status": "ok", "removed": w.id})

    async def _drain_worker(self, request: web.Request) -> web.Response:
        w = self._worker_or_404(request)
        body = await self._json_body(request, optional=True)
        if not isinstance(body, dict):
            raise MalformedRequest("drain body must be a JSON object")
        drain = body.get("drain", True)
        if type(drain) is not bool:
            raise MalformedRequest("'drain' must be a boolean", param="drain")
        self.pool.drain(w.id, drain)
        return web.json_response({"status": "ok", "worker": w.describe(time.monotonic())})

    async def _index_info(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        st = self.index.stats()
        hot = [{"hash": f"{h.hash:016x}", "depth": h.depth, "rate": h.rate,
                "holders": list(h.holders)}
               for h in self.index.hot_prefixes(now, k=self.cfg.index.hot_k)]
        return web.json_response({
            "stats": {f: getattr(st, f) for f in st.__slots__},
            "hot_prefixes": hot,
            "policy": {"name": self.policy.name, **self.policy.describe()},
        }, dumps=lambda o: json.dumps(o, default=str))

    async def _reload_handler(self, request: web.Request) -> web.Response:
        if not self.cfg.path:
            return json_error(409, "the router was started without --config; nothing to "
                              "reload", "invalid_request_error", "no_config_file")
        ok, message, added, removed = await self.reload()
        if not ok:
            return json_error(400, message, "invalid_request_error", "invalid_config")
        return web.json_response({"status": "ok", "added": added, "removed": removed,
                                  "summary": message})

    async def _register(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict):
            raise MalformedRequest("registration must be a JSON object")
        for k in ("worker_id", "url", "epoch"):
            if not isinstance(body.get(k), str) or not body[k]:
                raise MalformedRequest(f"'{k}' must be a non-empty string", param=k)
        models = body.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise MalformedRequest("'models' must be a list of strings", param="models")
        try:
            url = parse_worker_url(body["url"], "url")
        except ConfigError as exc:
            raise MalformedRequest(str(exc), param="url") from None
        bb = body.get("block_bytes")
        if bb is not None and (type(bb) is not int or bb <= 0):
            raise MalformedRequest("'block_bytes' must be a positive integer", param="block_bytes")
        ours = self.cfg.keys.block_bytes
        if bb is not None and bb != ours:
            # every hash it would report is one we never look up: refuse loudly
            self.metrics.registrations_refused.labels(reason=ev.STATUS_BLOCK_BYTES_MISMATCH).inc()
            log.warning("refused registration of %s (%s): it hashes %d-byte blocks, this "
                        "router keys.block_bytes=%d", body["worker_id"], url, bb, ours)
            return web.json_response({
                "status": ev.STATUS_BLOCK_BYTES_MISMATCH, "block_bytes": ours,
                "error": {"message": f"agent block_bytes {bb} != router keys.block_bytes "
                                     f"{ours}: start the agent with --block-bytes {ours} "
                                     "(or change the router's keys.block_bytes)",
                          "type": "invalid_request_error", "param": "block_bytes",
                          "code": ev.STATUS_BLOCK_BYTES_MISMATCH}}, status=409)
        w = self.pool.register(body["worker_id"], url, body["epoch"], models, bb)
        self._models_cache = None
        return web.json_response({"status": ev.STATUS_OK, "worker_id": w.id})

    async def _events(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        batch = ev.parse_batch(body)
        status, word = self.feedback.apply(batch, time.monotonic())
        return web.json_response({"status": word}, status=status)

    # ---------------------------------------------------------------- reload

    def _file_mtime(self) -> float | None:
        if not self.cfg.path:
            return None
        try:
            return os.stat(self.cfg.path).st_mtime_ns
        except OSError:
            return None

    async def _watch_config(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reload.poll_interval_s)
            m = self._file_mtime()
            if m is not None and m != self._mtime:
                self._mtime = m
                await self.reload()

    async def reload(self) -> tuple[bool, str, list[str], list[str]]:
        """Re-reads the config file. Validates everything first; an invalid file
        leaves the running config untouched (logged, counted, returned). In-flight
        requests are unaffected; worker list changes apply at once.

        Returns (ok, message or summary, added ids, removed ids)."""
        async with self._reload_lock:
            path = self.cfg.path
            self._mtime = self._file_mtime()
            try:
                new = with_overrides(load_config(path), **self.overrides)
                tenants = TenantResolver(new.keys.tenant)
                admin = BearerAuth(new.auth.admin_token_env, "admin")
                agent = BearerAuth(new.auth.agent_token_env, "agent")
                check_exposure(new, admin, agent)
                policy = self.policy
                if new.policy != self.cfg.policy:
                    policy = build_policy_from(new.policy)
            except ConfigError as exc:
                self.metrics.reload_failures.inc()
                log.error("config reload of %s refused, keeping the running config: %s",
                          path, exc)
                return False, str(exc), [], []
            old = self.cfg
            if new.listen != old.listen:
                log.warning("listen address changes need a restart (still on %s:%d)",
                            old.listen.host, old.listen.port)
                new = with_overrides(new, listen=old.listen)
            if new.keys.block_bytes != old.keys.block_bytes:
                log.warning("keys.block_bytes changed: the index restarts cold")
                for wid in list(self.index.workers()):
                    self.index.clear(wid)
                # agents that registered with the old size are refused from now on
                self.feedback.block_bytes = new.keys.block_bytes
            self.cfg = new
            self.pool.cfg = new
            self.policy = policy
            self.tenants = tenants
            self.admin_auth, self.agent_auth = admin, agent
            self.index.max_bytes = new.index.max_bytes
            lim = new.limits
            a = self.admission
            a.limit, a.max_queue = lim.max_concurrency, lim.max_queue
            a.timeout_s, a.retry_after_s = lim.queue_timeout_s, lim.retry_after_s
            if self.upstream is not None:
                self.upstream.connect_timeout_s = new.timeouts.connect_s
            added, removed = self.pool.sync_config(new.workers)
            self.metrics.reloads.inc()
            log.info("config reloaded from %s: %s (added %s, removed %s)", path,
                     new.summary(), added, removed)
            return True, new.summary(), added, removed


class RouterServer:
    """A ``Router`` listening: the raw front (router.proxy.FrontServer) for the data
    plane, the aiohttp app (same port, handed over per connection) for the rest.

    Lifecycle: ``await start()`` (runs the app's startup: client sessions, health
    checks, reload watcher) -> ``port``; ``await aclose()`` stops accepting,
    finishes in-flight requests for up to ``limits.shutdown_timeout_s``, then runs
    the app's cleanup. Idempotent.
    """

    def __init__(self, router: Router, host: str | None = None, port: int | None = None) -> None:
        self.router = router
        self.host = router.cfg.listen.host if host is None else host
        self.port = router.cfg.listen.port if port is None else port
        self._runner: web.AppRunner | None = None
        self._front = None
        self._closed = False

    async def start(self) -> int:
        from router.proxy import FrontServer

        r = self.router
        self._runner = web.AppRunner(r.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=r.cfg.limits.shutdown_timeout_s)
        await self._runner.setup()
        routes = {e.value.encode(): self._route(e) for e in Endpoint}
        self._front = FrontServer(routes, self._runner.server,
                                  lambda: r.cfg.limits.max_body_bytes)
        try:
            self.port = await self._front.start(self.host, self.port)
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError("listen", f"cannot listen on {self.host}:{self.port}: "
                              f"{exc.strerror or exc}") from None
        return self.port

    def _route(self, endpoint: Endpoint):
        serve = self.router.serve

        async def handler(ex) -> None:
            await serve(ex, endpoint)
        return handler

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._front is not None:
            await self._front.aclose(self.router.cfg.limits.shutdown_timeout_s)
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> "RouterServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
