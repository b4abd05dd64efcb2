"""The router's aiohttp application: admin API, agent API, probes, metrics, reload.

The data plane (one client request from admission to its last byte) lives in
``router.dataplane``; the ``Router`` owns one ``DataPlane`` and reconfigures it on
reload.

Endpoints::

    POST /v1/completions, /v1/chat/completions, /generate      data plane
    GET  /v1/models            union of the routable workers' models
    GET  /health               the router process is up
    GET  /readiness            200 once at least one worker is healthy (and, with a bus,
                               the stream's history is applied), else 503
    GET  /metrics              Prometheus text (no prefix hashes: router.metrics)
    GET  /openapi.json         the OpenAPI 3 description of all of this (protocol.openapi)
    GET/POST /admin/workers, DELETE /admin/workers/{id}, POST /admin/workers/{id}/drain
    GET  /admin/index          index stats, hot prefixes, policy.describe()
    POST /admin/reload         re-read the config file (400 with the message if invalid)
    POST /internal/v1/register, /internal/v1/events            agents (protocol.events)

Listening (``RouterServer``): the raw HTTP/1.1 front of ``router.front`` serves the
three data-plane POST paths itself (parsed by httptools) and hands any other
request, with its connection, to this aiohttp app on the same port — aiohttp's
request machinery cost about as much as the whole rest of a proxied request. The
same ``Router.serve`` also runs behind the aiohttp app's own data-plane routes
(``AiohttpExchange``), for embedding and tests.

Every error is an OpenAI-style JSON body (``protocol.errors``); bad input is never a
500. Lifecycle: the client session, health checks, the reload watcher and warm-up
tasks live in ``cleanup_ctx``; ``aclose()`` of the pool runs there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import aiohttp
from aiohttp import web

from protocol import events as ev
from protocol import openapi
from service import http_errors, jsonbody
from router.auth import TenantResolver, check_exposure
from service.auth import BearerAuth
from router.config import (
    MISSING, Config, WorkerSpec, build_policy_from, check_engine_fields, default_worker_id,
    load_config,
    parse_worker_url, with_overrides, parse_section,
)
from router.dataplane import (
    REQUEST_ID_HEADER, TENANT_HEADER, WORKER_HEADER, AiohttpExchange, DataPlane,
)
from router.bus.replica import BusReplica
from router.discovery import Discovery
from router.autoscale import fleet_signal, params_from
from router.engines.manager import Engines
from router.traffic_log import TrafficLog
from protocol.errors import (
    ConfigError, MalformedRequest, NotFound, RequestError, RequestTimeout, retry_after_header,
)
from protocol.identifiers import id_problem, models_problem
from service.tenancy import TenantSalts
from router.feedback import Feedback
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from router import served
from router.pool import Pool, Source
from router.prefix_index import PrefixIndex
from protocol.prefix_keys import Endpoint
from router.upstream import UpstreamPool

log = logging.getLogger("radixfleet.router")

__all__ = ["Router", "RouterServer", "TENANT_HEADER", "WORKER_HEADER", "REQUEST_ID_HEADER"]

_JSON = "application/json"


def json_error(status: int, message: str, etype: str, code: str,
               param: str | None = None, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "code": code, "param": param}}
    return web.Response(body=json.dumps(body).encode(), status=status, content_type=_JSON,
                        headers=headers)


def error_response(exc: RequestError, headers: dict | None = None) -> web.Response:
    h = dict(headers or {})
    if exc.retry_after_s is not None:
        h["Retry-After"] = retry_after_header(exc.retry_after_s)
    return web.Response(body=json.dumps(exc.to_json()).encode(), status=exc.status,
                        content_type=_JSON, headers=h)


def config_file_version(path: str) -> tuple[int, int, int, int] | None:
    """What the reload watcher compares: (device, inode, mtime ns, size) of the file
    ``path`` resolves to, or None if it cannot be read. ``os.stat`` follows the
    ConfigMap volume's symlinks (``router.yaml -> ..data/router.yaml``, ``..data ->
    ..<timestamp>``), so the kubelet's atomic swap shows as a new inode even when
    the new file's mtime equals the old one's (coarse timestamps, copies that keep
    mtimes)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


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
        self.salts = TenantSalts.from_env(cfg.keys.tenant_salt_env, self.agent_auth.token)
        self.tenants = TenantResolver(cfg.keys.tenant, salts=self.salts)
        self.pool = Pool(cfg, self.index)
        self.engines = Engines(cfg, self.pool, self.index, self.metrics.registry)
        self.feedback = Feedback(self.pool, self.index, self.metrics, cfg.keys.block_bytes)
        self.session: aiohttp.ClientSession | None = None  # health checks, models, warm-ups
        self._tasks: set[asyncio.Task] = set()
        #: per-request traffic log (router.traffic_log), when traffic_log.enabled
        self.traffic = TrafficLog(cfg.traffic_log) if cfg.traffic_log.enabled else None
        self.dataplane = DataPlane(cfg, self.policy, self.tenants, self.pool, self.index,
                                   self.metrics, self.engines, self._spawn, self.traffic)
        #: router.bus.replica.BusReplica while the app runs with ``bus.url`` set
        self.bus: BusReplica | None = None
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
            r.add_post(e.value, self.dataplane.aiohttp_handler(e))
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
        r.add_get("/openapi.json", self._openapi)
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
        dp = self.dataplane
        dp.session = self.session
        dp.upstream = UpstreamPool(connect_timeout_s=self.cfg.timeouts.connect_s)
        self.discovery = Discovery(self.cfg.discovery, self.pool, self.metrics.registry)
        if self.cfg.bus.enabled() and self.bus is None:
            self.bus = BusReplica(self.cfg.bus, pool=self.pool, index=self.index,
                                  feedback=self.feedback, block_bytes=self.cfg.keys.block_bytes,
                                  registry=self.metrics.registry,
                                  policy=lambda: self.policy)
        try:
            await self.pool.start(self.session)
            await self.engines.start(self.session)
            await self.discovery.start()
            if self.traffic is not None:
                self.traffic.start()  # ConfigError for an unwritable directory: refuse
                self.metrics.watch_traffic_log(self.traffic)
            if self.bus is not None:
                await self.bus.start()
                dp.bus = self.bus
            if self.cfg.path and self.cfg.reload.watch:
                self._spawn(self._watch_config())
            yield
        finally:
            dp.bus = None
            if self.bus is not None:
                await self.bus.aclose()
            await self.discovery.aclose()
            if self.traffic is not None:
                await self.traffic.aclose()
            await self.engines.aclose()
            await self.pool.aclose()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await dp.upstream.aclose()
            await self.session.close()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def aclose(self) -> None:
        """Stops background work (the app's cleanup does this too). Idempotent."""
        await self.pool.aclose()

    @property
    def admission(self):
        """The data plane's admission control (``router.dataplane.Admission``)."""
        return self.dataplane.admission

    @property
    def upstream(self) -> UpstreamPool | None:
        """The data plane's upstream connection pool (set while the app runs)."""
        return self.dataplane.upstream

    async def _read_body(self, request: web.Request) -> bytes:
        """The body of an aiohttp request, within ``limits.max_body_bytes`` and
        ``limits.body_timeout_s`` (408 after it)."""
        lim = self.cfg.limits
        try:
            return await asyncio.wait_for(AiohttpExchange(request).body(lim.max_body_bytes),
                                          lim.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"request body not received within "
                                 f"{lim.body_timeout_s:g}s") from None

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.router_spec())
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readiness(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        healthy = [w.id for w in self.pool if w.health.value == "healthy"]
        routable = [w.id for w in self.pool.routable_workers(now)]
        ready = bool(healthy)
        body = {"ready": ready, "healthy": healthy, "routable": routable}
        if self.bus is not None:
            caught_up = self.bus.ready()
            body["bus"] = self.bus.describe()
            body["ready"] = ready = ready and caught_up
        if ready:
            return web.json_response(body)
        return web.json_response(body, status=503, headers={
            "Retry-After": retry_after_header(self.cfg.health.interval_s)})

    def _scale_signal(self, now: float):
        """The prefix-aware autoscaling signal (router.autoscale), from the demand
        meter the data plane feeds, the index's hot prefixes and the routable views."""
        a = self.cfg.autoscale
        return fleet_signal(now, self.dataplane.demand, self.index, self.pool.views(now),
                            params_from(a), lead_s=a.startup_s, hot_k=a.hot_k,
                            block_tokens=self.cfg.keys.block_bytes // 4)

    async def _metrics(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        self.metrics.refresh(self.pool, self.index, now, self.cfg.index.hot_k)
        self.engines.refresh(now)
        self.metrics.set_autoscale(self._scale_signal(now))
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
                    data = jsonbody.loads(await r.content.read(1 << 20),
                                          what="the worker's /v1/models answer")
                    served.parse_models_answer(data)  # well-formed, bounded
                    return data["data"]
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, MalformedRequest):
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
        return jsonbody.loads(raw)  # MalformedRequest for anything but bounded JSON

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
            check_engine_fields(spec, "worker")
        except ConfigError as exc:
            raise MalformedRequest(str(exc)) from None
        wid = spec.id or default_worker_id(url)
        problem = id_problem(wid)
        if problem:
            raise MalformedRequest(problem, param="id")
        try:
            w = self.pool.add(wid, url, Source.ADMIN, spec.weight, spec.prefill_tokens_per_s,
                              spec)
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
            "autoscale": self._scale_signal(now).to_json(),
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
        for k in ("worker_id", "epoch"):
            problem = id_problem(body[k], f"'{k}'")
            if problem:
                raise MalformedRequest(problem, param=k)
        models = body.get("models", [])
        problem = models_problem(models)
        if problem:
            raise MalformedRequest(problem, param="models")
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

    def _file_mtime(self) -> tuple[int, int, int, int] | None:
        if not self.cfg.path:
            return None
        return config_file_version(self.cfg.path)

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
                admin = BearerAuth(new.auth.admin_token_env, "admin")
                agent = BearerAuth(new.auth.agent_token_env, "agent")
                check_exposure(new, admin, agent)
                salts = TenantSalts.from_env(new.keys.tenant_salt_env, agent.token)
                if salts.same_keys(self.salts):
                    salts = self.salts  # keep its caches
                tenants = TenantResolver(new.keys.tenant, salts=salts)
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
                if self.bus is not None:
                    self.bus.block_bytes = new.keys.block_bytes
            self.cfg = new
            self.pool.cfg = new
            self.policy = policy
            self.tenants = tenants
            if tenants.salts is not self.salts:
                log.warning("the tenant salt secret changed: every prefix key changes, the "
                            "index restarts cold")
                for wid in list(self.index.workers()):
                    self.index.clear(wid)
                self.salts = tenants.salts
            self.admin_auth, self.agent_auth = admin, agent
            self.index.max_bytes = new.index.max_bytes
            self.dataplane.configure(new, policy, tenants)
            self.engines.configure(new)
            added, removed = self.pool.sync_config(new.workers)
            self.metrics.reloads.inc()
            log.info("config reloaded from %s: %s (added %s, removed %s)", path,
                     new.summary(), added, removed)
            return True, new.summary(), added, removed


class RouterServer:
    """A ``Router`` listening: the raw front (router.front.FrontServer) for the data
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
        from router.front import FrontServer

        r = self.router
        self._runner = web.AppRunner(r.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=r.cfg.limits.shutdown_timeout_s)
        await self._runner.setup()
        routes = {e.value.encode(): self._route(e) for e in Endpoint}
        lim = lambda: r.cfg.limits  # noqa: E731 - read at use: a reload may change them
        bad = r.metrics.bad_http
        fallback = http_errors.factory(
            self._runner, access_log=None, on_bad_http=lambda st: bad.labels(str(st)).inc(),
            # an idle handed-over connection (or one trickling its next head) is closed
            keepalive_timeout=r.cfg.limits.header_timeout_s)
        self._front = FrontServer(routes, fallback, lambda: lim().max_body_bytes,
                                  head_timeout_s=lambda: lim().header_timeout_s,
                                  body_timeout_s=lambda: lim().body_timeout_s)
        # Routable as soon as it listens: the first health round (bounded by one
        # check's timeout) runs before the socket opens.
        await r.pool.first_round(r.cfg.health.timeout_s + 0.5)
        try:
            self.port = await self._front.start(self.host, self.port)
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError("listen", f"cannot listen on {self.host}:{self.port}: "
                              f"{exc.strerror or exc}") from None
        return self.port

    def _route(self, endpoint: Endpoint):
        serve = self.router.dataplane.serve

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
