"""The admin API: the worker list, the index and policy state, reload.

    GET    /admin/workers               every worker with its health, load and source;
                                        the recent shed decisions with their inputs
    POST   /admin/workers               {url, id?, weight?, prefill_tokens_per_s?, kind?, ...}
                                        -> 201; 400 bad spec; 409 the id exists
    DELETE /admin/workers/{id}          -> 200; 404 unknown
    POST   /admin/workers/{id}/drain    {drain: true|false} (default true)
    GET    /admin/index                 index stats, hot prefixes (hashes) with holders,
                                        the autoscaling signal, policy.describe()
    GET    /admin/decisions?n=&candidates=  the last n (default 20) requests' routing
                                        decisions, newest first: candidates' scores,
                                        the rule that decided, the outcome
                                        (radixfleet.route.decisions; decisions.size of them kept)
    POST   /admin/reload                {allow_security_downgrade?} (optional body):
                                        re-read the config file: 200 {added, removed},
                                        400 the file's error (invalid, empty, or a
                                        security downgrade not asked for: radixfleet.config.reload),
                                        409 started without --config

Every route sits behind the admin token (``auth.admin_token_env``; open only on
loopback). Per-prefix detail (hashes) is served here and nowhere public: a prefix
hash is a tenant's prompt fingerprint.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

from aiohttp import web

from radixfleet.common.auth import BearerAuth
from radixfleet.config import (
    Config,
    WorkerSpec,
    check_engine_fields,
    default_worker_id,
    parse_section,
    parse_worker_url,
)
from radixfleet.fleet.pool import Pool, Source
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.policies.base import Policy
from radixfleet.route.decisions import DEFAULT_CANDIDATES, MAX_CANDIDATES, MAX_SIZE, DecisionRing
from radixfleet.route.shedding import Shedder
from radixfleet.server.http_api import guarded, json_body, json_error
from radixfleet.wire.errors import ConfigError, MalformedRequest, NotFound
from radixfleet.wire.identifiers import id_problem


class AdminHost(Protocol):
    """What the admin API reads and calls on the router (``radixfleet.server.app.Router``); each
    attribute is read per request, so a reload's replacements are seen at once."""

    cfg: Config
    pool: Pool
    index: PrefixIndex
    policy: Policy
    admin_auth: BearerAuth

    def scale_signal(self, now: float): ...

    @property
    def shedder(self) -> Shedder: ...  # its recent shed decisions, with their inputs

    @property
    def decisions(self) -> DecisionRing: ...  # the recent routing decisions

    async def reload(
        self, *, allow_security_downgrade: bool = False
    ) -> tuple[bool, str, list[str], list[str]]: ...


class AdminAPI:
    def __init__(self, host: AdminHost) -> None:
        self.host = host

    def add_routes(self, r: web.UrlDispatcher) -> None:
        g = lambda fn: guarded(lambda: self.host.admin_auth, fn)  # noqa: E731
        r.add_get("/admin/workers", g(self.list_workers))
        r.add_post("/admin/workers", g(self.add_worker))
        r.add_delete("/admin/workers/{id}", g(self.remove_worker))
        r.add_post("/admin/workers/{id}/drain", g(self.drain_worker))
        r.add_get("/admin/index", g(self.index_info))
        r.add_get("/admin/decisions", g(self.recent_decisions))
        r.add_post("/admin/reload", g(self.reload))

    async def list_workers(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response(
            {
                "workers": [w.describe(now) for w in self.host.pool],
                "recent_sheds": list(self.host.shedder.recent),
            }
        )

    async def add_worker(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.host.cfg.limits)
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
            w = self.host.pool.add(wid, url, Source.ADMIN, spec.weight, spec.prefill_tokens_per_s, spec)
        except ValueError as exc:
            return json_error(409, str(exc), "invalid_request_error", "conflict")
        return web.json_response({"status": "ok", "worker": w.describe(time.monotonic())}, status=201)

    def _worker_or_404(self, request: web.Request):
        wid = request.match_info["id"]
        w = self.host.pool.get(wid)
        if w is None:
            raise NotFound(f"unknown worker {wid!r}")
        return w

    async def remove_worker(self, request: web.Request) -> web.Response:
        w = self._worker_or_404(request)
        self.host.pool.remove(w.id)
        return web.json_response({"status": "ok", "removed": w.id})

    async def drain_worker(self, request: web.Request) -> web.Response:
        w = self._worker_or_404(request)
        body = await json_body(request, self.host.cfg.limits, optional=True)
        if not isinstance(body, dict):
            raise MalformedRequest("drain body must be a JSON object")
        drain = body.get("drain", True)
        if type(drain) is not bool:
            raise MalformedRequest("'drain' must be a boolean", param="drain")
        self.host.pool.drain(w.id, drain)
        return web.json_response({"status": "ok", "worker": w.describe(time.monotonic())})

    async def index_info(self, request: web.Request) -> web.Response:
        h = self.host
        now = time.monotonic()
        st = h.index.stats()
        hot = [
            {"hash": f"{p.hash:016x}", "depth": p.depth, "rate": p.rate, "holders": list(p.holders)}
            for p in h.index.hot_prefixes(now, k=h.cfg.index.hot_k)
        ]
        return web.json_response(
            {
                "stats": {f: getattr(st, f) for f in st.__slots__},
                "hot_prefixes": hot,
                "autoscale": h.scale_signal(now).to_json(),
                "policy": {"name": h.policy.name, **h.policy.describe()},
            },
            dumps=lambda o: json.dumps(o, default=str),
        )

    async def recent_decisions(self, request: web.Request) -> web.Response:
        q = request.query
        unknown = sorted(set(q) - {"n", "candidates"})
        if unknown:
            raise MalformedRequest(
                f"unknown parameter {unknown[0]!r}; valid: candidates, n", param=unknown[0]
            )
        n = _count(q, "n", 20, MAX_SIZE)
        candidates = _count(q, "candidates", DEFAULT_CANDIDATES, MAX_CANDIDATES)
        ring = self.host.decisions
        return web.json_response(
            {"size": ring.size, "kept": len(ring), "decisions": ring.recent(n, candidates)}
        )

    async def reload(self, request: web.Request) -> web.Response:
        if not self.host.cfg.path:
            return json_error(
                409,
                "the router was started without --config; nothing to reload",
                "invalid_request_error",
                "no_config_file",
            )
        body = await json_body(request, self.host.cfg.limits, optional=True)
        if not isinstance(body, dict):
            raise MalformedRequest("reload body must be a JSON object")
        unknown = sorted(set(body) - {"allow_security_downgrade"})
        if unknown:
            raise MalformedRequest(
                f"unknown field {unknown[0]!r}; valid: allow_security_downgrade", param=unknown[0]
            )
        allow = body.get("allow_security_downgrade", False)
        if type(allow) is not bool:
            raise MalformedRequest(
                "'allow_security_downgrade' must be a boolean", param="allow_security_downgrade"
            )
        ok, message, added, removed = await self.host.reload(allow_security_downgrade=allow)
        if not ok:
            return json_error(400, message, "invalid_request_error", "invalid_config")
        return web.json_response({"status": "ok", "added": added, "removed": removed, "summary": message})


def _count(query, name: str, default: int, hi: int) -> int:
    """A query parameter holding an integer in ``[1, hi]`` (absent: ``default``);
    anything else a 400 naming it."""
    raw = query.getall(name, None)
    if raw is None:
        return default
    v = raw[0] if len(raw) == 1 else ""
    if not (v.isascii() and v.isdigit()) or len(v) > 7 or not 1 <= int(v) <= hi:
        raise MalformedRequest(f"'{name}' must be one integer in [1, {hi}]", param=name)
    return int(v)
