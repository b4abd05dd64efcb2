"""The agent API (DESIGN.md contract 2): agents announce themselves and push their
cache events and load.

    POST /internal/v1/register   {worker_id, url, epoch, models?, block_bytes?}
                                 -> 200 {status: ok}; 400 malformed; 409
                                 block_bytes_mismatch (its hashes would never match ours)
    POST /internal/v1/events     a ``protocol.events`` batch -> ``router.feedback``
                                 (epochs, sequence gaps, snapshots); its status word

Both sit behind the agent token (``auth.agent_token_env``; open only on loopback).
With a bus, the same batches arrive from the stream instead (``router.bus.replica``)
and take the same ``Feedback.apply`` path.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from aiohttp import web

from protocol import events as ev
from protocol.errors import ConfigError, MalformedRequest
from router.config import Config, parse_worker_url
from router.feedback import Feedback
from router.http_api import guarded, json_body
from router.metrics import Metrics
from router.pool import Pool
from service.auth import BearerAuth

log = logging.getLogger("radixfleet.router")


class AgentHost(Protocol):
    """What the agent API reads and calls on the router (``router.app.Router``), read
    per request (a reload may replace ``cfg`` and ``agent_auth``)."""

    cfg: Config
    pool: Pool
    feedback: Feedback
    metrics: Metrics
    agent_auth: BearerAuth

    def models_changed(self) -> None: ...


class AgentAPI:
    def __init__(self, host: AgentHost) -> None:
        self.host = host

    def add_routes(self, r: web.UrlDispatcher) -> None:
        g = lambda fn: guarded(lambda: self.host.agent_auth, fn)  # noqa: E731
        r.add_post(ev.REGISTER_PATH, g(self.register))
        r.add_post(ev.EVENTS_PATH, g(self.events))

    async def register(self, request: web.Request) -> web.Response:
        h = self.host
        reg = ev.parse_registration(await json_body(request, h.cfg.limits))
        try:
            url = parse_worker_url(reg.url, "url")
        except ConfigError as exc:
            raise MalformedRequest(str(exc), param="url") from None
        bb = reg.block_bytes
        ours = h.cfg.keys.block_bytes
        if bb is not None and bb != ours:
            # every hash it would report is one we never look up: refuse loudly
            h.metrics.registrations_refused.labels(reason=ev.STATUS_BLOCK_BYTES_MISMATCH).inc()
            log.warning("refused registration of %s (%s): it hashes %d-byte blocks, this "
                        "router keys.block_bytes=%d", reg.worker_id, url, bb, ours)
            return web.json_response({
                "status": ev.STATUS_BLOCK_BYTES_MISMATCH, "block_bytes": ours,
                "error": {"message": f"agent block_bytes {bb} != router keys.block_bytes "
                                     f"{ours}: start the agent with --block-bytes {ours} "
                                     "(or change the router's keys.block_bytes)",
                          "type": "invalid_request_error", "param": "block_bytes",
                          "code": ev.STATUS_BLOCK_BYTES_MISMATCH}}, status=409)
        w = h.pool.register(reg.worker_id, url, reg.epoch, list(reg.models), bb)
        h.models_changed()
        return web.json_response({"status": ev.STATUS_OK, "worker_id": w.id})

    async def events(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.host.cfg.limits)
        batch = ev.parse_batch(body)
        status, word = self.host.feedback.apply(batch, time.monotonic())
        return web.json_response({"status": word}, status=status)
