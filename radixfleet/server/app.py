"""The router's composition root and its aiohttp application: builds the index,
pool, policy, engines, feedback, data plane, bus and discovery from the config, runs
their lifecycle, serves the probes and metrics, and applies reloads.

The data plane (one client request from admission to its last byte) lives in
``radixfleet.server.dataplane``, the admin API in ``radixfleet.server.admin_api``, the agent API in
``radixfleet.server.agent_api``, the validation half of a reload in ``radixfleet.config.reload``; the
``Router`` owns one of each and reconfigures them on reload.

Endpoints, by listener (``RouterServer``)::

    data port (listen.host:port), the raw front of radixfleet.server.front alone:
    POST /v1/completions, /v1/chat/completions, /generate      data plane
    POST /v1/prefetch          a request known before it is sent (radixfleet.server.prefetch)
    GET  /v1/models            union of the routable workers' models (authenticated as
                               the data plane is: keys.tenant)
    GET  /health, /readiness   the probes (below; on both listeners)
    POST /internal/v1/register, /internal/v1/events            agents (radixfleet.server.agent_api)
    anything else              404 JSON (an admin path's names the admin listener)

    admin listener (admin.host:port, loopback by default), ``Router.admin_app``:
    GET  /health               the router process is up
    GET  /readiness            200 once every configured worker has answered its first
                               probe or failed it, served models are known and one
                               worker is healthy (and, with a bus, the stream's history
                               is applied: Pool.readiness) and, in the first
                               seconds, every healthy engine's tokenizer is loaded
                               and its KV events joined (Engines.settling), else
                               503 (``waiting``: the workers it waits for)
    GET  /metrics              Prometheus text (no prefix hashes: radixfleet.server.metrics), to the
                               metrics or admin token, or without a metrics token to
                               loopback peers (radixfleet.server.auth.check_metrics)
    GET  /openapi.json         the OpenAPI 3 description of all of this (radixfleet.wire.openapi)
    GET/POST /admin/workers, DELETE /admin/workers/{id}, POST /admin/workers/{id}/drain
    GET  /admin/index          index stats, hot prefixes, policy.describe()
    GET  /admin/decisions      the recent routing decisions
    POST /admin/reload         re-read the config file (400 with the message if invalid,
                               empty, or a security downgrade not asked for: radixfleet.config.reload)

The data port's handlers are written once, on an exchange (the data plane's;
``radixfleet.server.http_api.answered`` for the rest), and served by the raw front and by
``Router.app``: the whole API on one aiohttp app, for embedding (``radixfleet
gateway``) and tests, through ``ReadExchange``.

Every error is an OpenAI-style JSON body (``radixfleet.wire.errors``); bad input is never a
500. Lifecycle: the client session, health checks, the reload watcher and warm-up
tasks live in ``cleanup_ctx``; ``aclose()`` of the pool runs there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from radixfleet.bus.replica import BusReplica
from radixfleet.common import http_errors, jsonbody
from radixfleet.config import MISSING, Config, check_event_binds, with_overrides
from radixfleet.config.reload import ConfigWatch, build, check_downgrade, failure_reason, prepare
from radixfleet.engines.manager import Engines
from radixfleet.fleet.discovery import Discovery
from radixfleet.fleet.pool import Pool
from radixfleet.fleet.registration import RegistrationGuard
from radixfleet.fleet.scaling_signal import fleet_signal, params_from
from radixfleet.index.feedback import Feedback
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import Endpoint
from radixfleet.route import served
from radixfleet.route.decisions import DecisionRing
from radixfleet.route.shedding import Shedder
from radixfleet.server import intake
from radixfleet.server.admin_api import AdminAPI
from radixfleet.server.agent_api import AgentAPI
from radixfleet.server.aiohttp_exchange import ReadExchange
from radixfleet.server.auth import check_metrics, metrics_exposure
from radixfleet.server.dataplane import (
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    WORKER_HEADER,
    DataPlane,
)
from radixfleet.server.http_api import Answer, answered, error_response, json_error
from radixfleet.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixfleet.server.metrics import Metrics
from radixfleet.server.prefetch import PREFETCH_PATH
from radixfleet.server.slow_clients import SlowClients
from radixfleet.server.traffic_log import TrafficLog
from radixfleet.server.upstream import UpstreamPool
from radixfleet.wire import openapi
from radixfleet.wire.errors import (
    ConfigError,
    MalformedRequest,
    NotFound,
    RequestError,
    retry_after_header,
)

if TYPE_CHECKING:  # the type only; RouterServer.start imports it when it listens
    from radixfleet.server.front import FrontServer

log = logging.getLogger("radixfleet.router")

__all__ = ["Router", "RouterServer", "TENANT_HEADER", "WORKER_HEADER", "REQUEST_ID_HEADER"]

_JSON = "application/json"


def merge_models(answers: list[list[dict]]) -> list[dict]:
    """The union of workers' ``/v1/models`` entries, one per model id (the first
    worker's, by id). Its ``max_model_len`` is the smallest any of its workers
    reported — a request within it fits whichever worker the router picks — and is
    left out when a worker serving the model reported none (unknown is not a limit)."""
    seen: dict[str, dict] = {}
    lens: dict[str, list] = {}
    for models in answers:
        for m in models:
            seen.setdefault(m["id"], m)
            lens.setdefault(m["id"], []).append(m.get("max_model_len"))
    out = []
    for k in sorted(seen):
        m = dict(seen[k])
        got = lens[k]
        if all(type(n) is int and n > 0 for n in got):
            m["max_model_len"] = min(got)
        else:
            m.pop("max_model_len", None)
        out.append(m)
    return out


class Router:
    """The router service: index, pool, policy, metrics, and the request logic.

    ``Router(cfg).app`` is the aiohttp application of the whole API (admin, agents,
    probes, and the data plane through ``AiohttpExchange``: embedding, tests);
    ``RouterServer(router)`` listens with the raw front on the data port and
    ``Router.admin_app`` on the admin listener. ``overrides`` (``section__key`` names,
    ``MISSING`` = absent) are reapplied on every reload so command-line options keep
    winning over the file.
    """

    def __init__(self, cfg: Config, *, overrides: dict[str, Any] | None = None) -> None:
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not MISSING}
        self.cfg = cfg
        self.metrics = Metrics()
        self.index = PrefixIndex(cfg.index.max_bytes, cfg.index.half_life_s)
        p = build(cfg)  # radixfleet.config.reload: what a reload rebuilds, built the same way
        check_event_binds(cfg)  # before anything binds: which side binds, said plainly
        self.policy, self.tenants, self.salts = p.policy, p.tenants, p.tenants.salts
        self.admin_auth, self.agent_auth = p.admin_auth, p.agent_auth
        self.metrics_auth = p.metrics_auth  # GET /metrics (radixfleet.server.auth.check_metrics)
        exposed = metrics_exposure(cfg, self.metrics_auth)
        if exposed:
            log.warning("%s", exposed)
        self.pool = Pool(cfg, self.index)
        self.engines = Engines(cfg, self.pool, self.index, self.metrics.registry, keyers=p.keyers)
        self.feedback = Feedback(self.pool, self.index, self.metrics, cfg.keys.block_bytes)
        #: who may register a worker, and at which addresses (radixfleet.fleet.registration)
        self.registration = RegistrationGuard(self.pool, self.metrics)
        self.session: aiohttp.ClientSession | None = None  # health checks, models, warm-ups
        self._tasks: set[asyncio.Task] = set()
        #: per-request traffic log (radixfleet.server.traffic_log), when traffic_log.enabled
        self.traffic = TrafficLog(cfg.traffic_log) if cfg.traffic_log.enabled else None
        self.dataplane = DataPlane(
            cfg,
            self.policy,
            self.tenants,
            self.pool,
            self.index,
            self.metrics,
            self.engines,
            self._spawn,
            self.traffic,
        )
        self.metrics.watch_tracing(lambda: self.dataplane.tracing)  # series while it traces
        #: radixfleet.bus.replica.BusReplica while the app runs with ``bus.url`` set
        self.bus: BusReplica | None = None
        self._models_cache: tuple[float, dict] | None = None
        #: request body bytes held, the raw front's and the app's together (radixfleet.server.intake)
        self.body_budget = intake.BodyBudget(cfg.limits.max_buffered_body_bytes)
        dropped = self.metrics.slow_clients_dropped
        #: the deadlines of the waits for a client to take its answer, both listeners'
        self.slow_clients = SlowClients(
            lambda: self.cfg.timeouts.client_idle_s,
            lambda: self.cfg.timeouts.total_s,
            lambda reason: dropped.labels(reason).inc(),
        )
        #: when the watcher reloads (radixfleet.config.reload); None without a file
        self._watch = ConfigWatch(cfg.path) if cfg.path else None
        self._reload_lock = asyncio.Lock()
        self.agent_api = AgentAPI(self)
        self.app = self._build_app(data=True)
        #: what the admin listener serves (RouterServer): no data-plane or agent path
        self.admin_app = self._build_app(data=False)

    # ------------------------------------------------------------------ setup

    def data_routes(self) -> dict[str, dict[str, tuple]]:
        """What the data port serves: path -> method -> (handler of an exchange, the
        screen its head passes before its body is read or None, what a peer gone
        before its body arrived is told or None). The raw front serves these
        (``RouterServer``), ``Router.app`` the same (``_exchange_route``)."""
        dp = self.dataplane

        def serve(endpoint: Endpoint):
            async def handler(ex) -> None:
                await dp.serve(ex, endpoint)

            handler.__name__ = f"proxy_{endpoint.name.lower()}"
            return handler

        def agent_screen(headers) -> None:
            self.agent_auth.check(headers.get("authorization"))  # read per request: reloads

        lim = lambda: self.cfg.limits  # noqa: E731 - read at use: a reload may change them
        routes: dict[str, dict[str, tuple]] = {
            e.value: {"POST": (serve(e), self.admit_head, None)} for e in Endpoint
        }
        routes[PREFETCH_PATH] = {"POST": (dp.prefetch, self.admit_head, None)}
        routes["/v1/models"] = {"GET": (answered(self.models, lim, self._rejected), self.admit_head, None)}
        routes["/health"] = {"GET": (answered(self.health, lim), None, None)}
        routes["/readiness"] = {"GET": (answered(self.readiness, lim), None, None)}
        for path, handler in self.agent_api.routes(lim).items():
            hangup = functools.partial(self.agent_api.hangup, "POST", path)
            routes[path] = {"POST": (handler, agent_screen, hangup)}
        return routes

    def _rejected(self, exc: RequestError) -> None:
        self.metrics.rejected.labels(str(exc.status), exc.code).inc()

    def _build_app(self, *, data: bool) -> web.Application:
        """The admin listener's app; with ``data``, the data port's routes too."""
        # Body size is enforced by the exchanges (a reload may change it).
        app = web.Application(client_max_size=2**62)
        app[intake.BODY_BUDGET] = self.body_budget
        r = app.router
        for path, methods in self.data_routes().items():
            if data or path in ("/health", "/readiness"):
                for method, (handler, screen, hangup) in methods.items():
                    r.add_route(method, path, self._exchange_route(handler, screen, hangup))
        r.add_get("/metrics", self._metrics)
        AdminAPI(self).add_routes(r)
        r.add_get("/openapi.json", self._openapi)
        known: dict[str | None, set[str]] = {}
        for res in r.resources():
            info = res.get_info()
            known.setdefault(info.get("path") or info.get("formatter"), set()).update(rt.method for rt in res)
        r.add_route("*", "/{tail:.*}", functools.partial(self._not_found, known, data))
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application):
        if self.cfg.bus.enabled() and self.bus is None:
            # first: a bus secret that cannot be read refuses the start (ConfigError)
            # before anything else is opened
            self.bus = BusReplica(
                self.cfg.bus,
                pool=self.pool,
                index=self.index,
                feedback=self.feedback,
                block_bytes=self.cfg.keys.block_bytes,
                registry=self.metrics.registry,
                policy=lambda: self.policy,
                agent_token=self.agent_auth.token,
                tenancy=lambda: self.dataplane.tenancy,
                url_check=self._check_worker_url,
            )
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=conn,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            headers=self.dataplane.hops.headers(),  # radixfleet.server.hops: whatever comes back is refused
        )
        dp = self.dataplane
        dp.session = self.session
        dp.upstream = UpstreamPool(
            connect_timeout_s=self.cfg.timeouts.connect_s,
            keepalive_s=self.cfg.timeouts.keepalive_s,
            body_limit=self.cfg.limits.max_response_bytes,
        )
        self.discovery = Discovery(self.cfg.discovery, self.pool, self.metrics.registry)
        tracing = None
        if self.cfg.tracing.enabled and dp.tracing is None:
            from radixfleet.server import tracing as _tracing  # the tracing extra (MissingExtra without it)

            tracing = _tracing.from_config(self.cfg.tracing)  # a missing exporter: ConfigError
        if tracing is not None:
            dp.use_tracing(tracing)
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
            if tracing is not None:  # the one this lifecycle made (a test's is its own)
                dp.use_tracing(None)
                await tracing.aclose()

    async def _check_worker_url(self, wid: str, url: str) -> None:
        """The registration rule for a bus registration's URL (``radixfleet.fleet.registration``)."""
        tokenless = not self.agent_auth.token
        await self.registration.check_url(wid, url, self.cfg.registration, tokenless=tokenless)

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def aclose(self) -> None:
        """Stops background work (the app's cleanup does this too). Idempotent."""
        await self.pool.aclose()

    @property
    def shedder(self) -> Shedder:
        return self.dataplane.shedder

    @property
    def decisions(self) -> DecisionRing:
        """The data plane's recent decisions (``GET /admin/decisions``)."""
        return self.dataplane.decisions

    @property
    def admission(self):
        """The data plane's admission control (``radixfleet.server.dataplane.Admission``)."""
        return self.dataplane.admission

    @property
    def upstream(self) -> UpstreamPool | None:
        """The data plane's upstream connection pool (set while the app runs)."""
        return self.dataplane.upstream

    def models_changed(self) -> None:
        """A worker registered: ``/v1/models`` is recomputed at its next request."""
        self._models_cache = None

    def admit_head(self, headers) -> None:
        """What a data-plane request's head alone decides, before its body is read or
        an admission slot taken: ``LoopDetected`` for one that came back to this
        router (``radixfleet.server.hops``), ``Unauthorized`` without credentials it needs,
        ``RateLimited`` for a tenant or key over its rate limit (``radixfleet.server.screen``)."""
        self.dataplane.hops.check(headers)
        self.dataplane.screen_head(headers)  # 401, or 429 over a rate limit (radixfleet.server.screen)

    def _exchange_route(self, handler, screen, hangup=None):
        """The aiohttp handler of a data-port route (an embedded app, tests): its
        ``screen`` on the headers first, then the body within its deadline and the
        body budget, and only then ``handler`` (the data plane takes its admission
        slot there), so a slow or unauthenticated body never holds a slot
        (``admit_head``). ``hangup(remote)``: a peer gone before its body arrived
        (counted, a 400 nobody reads), else that is the aiohttp server's."""

        async def route(request: web.Request) -> web.StreamResponse:
            lim = self.cfg.limits
            try:
                if screen is not None:
                    screen(request.headers)
                raw = await intake.read_body(
                    request, lim.max_body_bytes, lim.body_timeout_s, self.body_budget
                )
            except RequestError as exc:
                if screen == self.admit_head:
                    self._rejected(exc)
                resp = error_response(exc)
                resp.force_close()  # the rest of the body is never read
                return resp
            except ConnectionResetError:
                if hangup is None:
                    raise
                hangup(request.remote)
                return json_error(
                    400,
                    "the peer closed the connection before its request was read",
                    "invalid_request_error",
                    "peer_hangup",
                )
            try:
                ex = ReadExchange(request, raw, self.slow_clients)
                await handler(ex)
            finally:
                self.body_budget.give(len(raw))
            return await ex.sent()

        route.__name__ = handler.__name__
        return route

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.router_spec())

    async def health(self, ex, body) -> Answer:
        """``GET /health``: the process is up."""
        return 200, {"status": "ok"}, ()

    async def readiness(self, ex, body) -> Answer:
        """``GET /readiness`` (the module docstring)."""
        now = time.monotonic()
        healthy = [w.id for w in self.pool if w.health.value == "healthy"]
        routable = [w.id for w in self.pool.routable_workers(now)]
        ready, waiting = self.pool.readiness()
        settling = self.engines.settling(now)
        if settling:  # keyed in bytes, or the engine's KV events not yet joined
            ready = False
            waiting = waiting + [wid for wid in settling if wid not in waiting]
        body = {"ready": ready, "healthy": healthy, "routable": routable, "waiting": waiting}
        if self.bus is not None:
            caught_up = self.bus.ready()
            body["bus"] = self.bus.describe()
            body["ready"] = ready = ready and caught_up
        if ready:
            return 200, body, ()
        return 503, body, (("Retry-After", retry_after_header(self.cfg.health.interval_s)),)

    def scale_signal(self, now: float):
        """The prefix-aware autoscaling signal (radixfleet.fleet.scaling_signal), from the demand
        meter the data plane feeds, the index's hot prefixes and the routable views."""
        a = self.cfg.autoscale
        return fleet_signal(
            now,
            self.dataplane.demand,
            self.index,
            self.pool.views(now),
            params_from(a),
            lead_s=a.startup_s,
            hot_k=a.hot_k,
            block_tokens=self.cfg.keys.block_bytes // 4,
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            check_metrics(
                self.metrics_auth, self.admin_auth, request.headers.get("Authorization"), request.remote
            )
        except RequestError as exc:
            self.metrics.rejected.labels(str(exc.status), exc.code).inc()
            return error_response(exc)
        now = time.monotonic()
        self.metrics.refresh(self.pool, self.index, now, self.cfg.index.hot_k)
        self.engines.refresh(now)
        self.metrics.set_autoscale(self.scale_signal(now))
        self.metrics.body_bytes_held.set(self.body_budget.held)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def models(self, ex, body) -> Answer:
        """``GET /v1/models`` (its head screened as the data plane's: ``admit_head``)."""
        hop = self.dataplane.hops.headers(ex.headers)
        now = time.monotonic()
        cached = self._models_cache
        if cached is not None and now - cached[0] < 2.0:
            return 200, cached[1], ()
        workers = self.pool.routable_workers(now)

        async def fetch(w):
            try:
                async with self.session.get(
                    w.url + "/v1/models", headers=hop, timeout=aiohttp.ClientTimeout(total=2.0)
                ) as r:
                    if r.status != 200:
                        return []
                    data = jsonbody.loads(
                        await r.content.read(1 << 20), what="the worker's /v1/models answer"
                    )
                    served.parse_models_answer(data)  # well-formed, bounded
                    return data["data"]
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, MalformedRequest):
                return [{"id": m, "object": "model", "owned_by": w.id} for m in w.models]

        out = {"object": "list", "data": merge_models(await asyncio.gather(*(fetch(w) for w in workers)))}
        self._models_cache = (now, out)
        return 200, out, ()

    async def _not_found(self, known: dict, data: bool, request: web.Request) -> web.Response:
        allowed = known.get(request.path)
        if allowed:
            return json_error(
                405,
                f"method {request.method} not allowed on {request.path}; "
                f"allowed: {', '.join(sorted(allowed))}",
                "invalid_request_error",
                "method_not_allowed",
                headers={"Allow": ", ".join(sorted(allowed))},
            )
        if not data and request.path in self.data_routes():
            msg = f"{request.path} is served on the data port (listen), not the admin listener"
            return error_response(NotFound(msg))
        return error_response(NotFound(f"unknown path {request.path}"))

    # ---------------------------------------------------------------- reload

    async def _watch_config(self) -> None:
        watch = self._watch
        assert watch is not None, "the watcher runs only for a router started with a file"
        while True:
            await asyncio.sleep(self.cfg.reload.poll_interval_s)
            if watch.due():  # a file unchanged across two polls: whole, not being written
                await self.reload()

    async def reload(
        self, *, allow_security_downgrade: bool = False
    ) -> tuple[bool, str, list[str], list[str]]:
        """Re-reads the config file. Validates everything first; an invalid file, one
        that holds no settings, or one that lowers security without
        ``allow_security_downgrade`` (radixfleet.config.reload) leaves the running config
        untouched (logged at ERROR, counted by reason, returned). A downgrade applied
        as asked is logged at ERROR too. In-flight requests are unaffected; worker
        list changes apply at once.

        Returns (ok, message or summary, added ids, removed ids)."""
        async with self._reload_lock:
            path = self.cfg.path
            if self._watch is not None:
                self._watch.loading()
            try:
                # off the event loop: parsing a large file and loading tokenizers
                # (models:) take seconds that requests must not wait for
                p = await asyncio.get_running_loop().run_in_executor(
                    None,
                    functools.partial(
                        prepare,
                        path,
                        self.overrides,
                        salts=self.salts,
                        policy_cfg=self.cfg.policy,
                        policy=self.policy,
                        keyers=self.engines.model_keyers,
                    ),
                )
                lowered = check_downgrade(
                    self.cfg,
                    (self.admin_auth, self.agent_auth, self.metrics_auth),
                    p,
                    allow=allow_security_downgrade,
                )
            except ConfigError as exc:
                self.metrics.reload_failures.labels(reason=failure_reason(exc)).inc()
                log.error("config reload of %s refused, keeping the running config: %s", path, exc)
                return False, str(exc), [], []
            if lowered:
                log.error(
                    "config reload of %s lowers security, applied as asked (allow_security_downgrade): %s",
                    path,
                    "; ".join(lowered),
                )
            new, policy, tenants = p.cfg, p.policy, p.tenants
            old = self.cfg
            if new.listen != old.listen:
                log.warning(
                    "listen address changes need a restart (still on %s:%d)", old.listen.host, old.listen.port
                )
                new = with_overrides(new, listen=old.listen)
            if new.admin != old.admin:
                log.warning(
                    "admin listener changes need a restart (still on %s:%d)", old.admin.host, old.admin.port
                )
                new = with_overrides(new, admin=old.admin)
            if new.tracing != old.tracing:
                log.warning("tracing changes need a restart (tracing kept as it started)")
                new = with_overrides(new, tracing=old.tracing)
            if new.keys.block_bytes != old.keys.block_bytes:
                log.warning("keys.block_bytes changed: the index restarts cold")
                for wid in list(self.index.workers()):
                    self.index.clear(wid)
                # agents that registered with the old size are refused from now on
                self.feedback.configure(new.keys)
                if self.bus is not None:
                    self.bus.configure(new.keys)
            self.cfg = new
            self.pool.configure(new)
            self.policy = policy
            self.tenants = tenants
            if tenants.salts is not self.salts:
                log.warning(
                    "the tenant salt secret changed: every prefix key changes, the index restarts cold"
                )
                for wid in list(self.index.workers()):
                    self.index.clear(wid)
                self.salts = tenants.salts
            self.admin_auth, self.agent_auth = p.admin_auth, p.agent_auth
            self.metrics_auth = p.metrics_auth
            self.index.configure(new.index, time.monotonic())
            self.body_budget.configure(new.limits)
            self.dataplane.configure(new, policy, tenants)
            self.engines.configure(new, keyers=p.keyers)
            added, removed = self.pool.sync_config(new.workers)
            self.metrics.reloads.inc()
            log.info(
                "config reloaded from %s: %s (added %s, removed %s)", path, new.summary(), added, removed
            )
            return True, new.summary(), added, removed


#: paths of the admin listener that a request on the data port may be looking for
_ADMIN_PATHS = ("/metrics", "/openapi.json")


def _data_port_not_found(path: str) -> RequestError:
    """The data port's 404: an admin path's says where such paths are served (that an
    admin listener exists, not its address)."""
    if path in _ADMIN_PATHS or path == "/admin" or path.startswith("/admin/"):
        return NotFound(
            f"{path} is not served on the data port: the admin API, /metrics and "
            "/openapi.json are served on the router's admin listener, a port of its own (admin.port)"
        )
    return NotFound(f"unknown path {path}")


class RouterServer:
    """A ``Router`` listening: the raw front (radixfleet.server.front.FrontServer) alone on the
    data port (``Router.data_routes``), ``Router.admin_app`` on the admin listener
    (``admin``; port 0: a free one, in ``admin_port`` once started).

    Lifecycle: ``await start()`` (runs the app's startup: client sessions, health
    checks, reload watcher) -> ``port``; either address taken is a ``ConfigError``
    naming its key, with nothing left running; ``await aclose()`` stops accepting,
    finishes in-flight requests for up to ``limits.shutdown_timeout_s``, then runs
    the app's cleanup. Idempotent.
    """

    def __init__(
        self,
        router: Router,
        host: str | None = None,
        port: int | None = None,
        *,
        admin_host: str | None = None,
        admin_port: int | None = None,
    ) -> None:
        self.router = router
        cfg = router.cfg
        self.host = cfg.listen.host if host is None else host
        self.port = cfg.listen.port if port is None else port
        self.admin_host = cfg.admin.host if admin_host is None else admin_host
        self.admin_port = cfg.admin.port if admin_port is None else admin_port
        self._runner: web.AppRunner | None = None
        self._admin: asyncio.Server | None = None
        self._front: FrontServer | None = None
        self._closed = False

    async def start(self) -> int:
        from radixfleet.server.front import FrontServer, Route

        r = self.router
        if self.admin_port and self.admin_port == self.port:
            raise ConfigError(
                "admin.port", f"the admin listener needs a port of its own (listen.port is {self.port})"
            )
        self._runner = web.AppRunner(
            r.admin_app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=r.cfg.limits.shutdown_timeout_s,
        )
        await self._runner.setup()
        routes = {
            path.encode(): {m.encode(): Route(*route) for m, route in methods.items()}
            for path, methods in r.data_routes().items()
        }
        lim = lambda: r.cfg.limits  # noqa: E731 - read at use: a reload may change them
        bad = r.metrics.bad_http
        fd_limit = intake.raise_fd_limit()
        cap = intake.connection_cap(r.cfg.limits.max_connections, fd_limit)
        if cap < r.cfg.limits.max_connections:
            log.warning(
                "limits.max_connections=%d is more than the open-file limit (%d) "
                "allows: client connections capped at %d",
                r.cfg.limits.max_connections,
                fd_limit,
                cap,
            )
        refused, gone = r.metrics.connections_refused, r.metrics.client_disconnects
        self._front = FrontServer(
            routes,
            lambda: lim().max_body_bytes,
            head_timeout_s=lambda: lim().header_timeout_s,
            body_timeout_s=lambda: lim().body_timeout_s,
            budget=r.body_budget,
            max_connections=lambda: intake.connection_cap(lim().max_connections, fd_limit),
            on_refused=lambda reason: refused.labels(reason).inc(),
            on_gone=lambda phase: gone.labels(phase).inc(),
            on_bad_http=lambda st: bad.labels(str(st)).inc(),
            slow=r.slow_clients,
            not_found=_data_port_not_found,
        )
        # Routable as soon as it listens: the first health round (bounded by one
        # check's timeout) runs before the socket opens.
        await r.pool.first_round(r.cfg.health.timeout_s + 0.5)
        key, host, port = "admin", self.admin_host, self.admin_port
        try:
            self._admin = await http_errors.listen(
                self._runner,
                host,
                port,
                access_log=None,
                on_bad_http=lambda st: bad.labels(str(st)).inc(),
                keepalive_timeout=r.cfg.limits.header_timeout_s,
            )
            self.admin_port = self._admin.sockets[0].getsockname()[1]
            key, host, port = "listen", self.host, self.port
            self.port = await self._front.start(self.host, self.port)
        except OSError as exc:
            await self._stop_admin()
            await self._runner.cleanup()
            raise ConfigError(key, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        # no worker URL may lead to either listener
        r.registration.listening(self._front.socknames() + [s.getsockname() for s in self._admin.sockets])
        return self.port

    async def _stop_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            await self._admin.wait_closed()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._front is not None:
            await self._front.aclose(self.router.cfg.limits.shutdown_timeout_s)
        if self._admin is not None:
            self._admin.close()  # stops accepting; the runner's cleanup ends its requests
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
