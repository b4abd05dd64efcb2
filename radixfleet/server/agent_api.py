"""The agent API (docs/DESIGN.md contract 2): agents announce themselves and push their
cache events and load.

    POST /internal/v1/register   {worker_id, url, epoch, models?, block_bytes?, role?,
                                 scheduling_policy?}
                                 -> 200 {status: ok}; 400 malformed (a wildcard,
                                 link-local or user:password@ URL too); 400
                                 worker_url_is_router, 403 agent_token_required,
                                 403 worker_host_not_allowed (``radixfleet.fleet.registration``);
                                 409 block_bytes_mismatch (its hashes would never
                                 match ours); 409 worker_id_taken (a worker at
                                 another URL holds the id: ``Pool.register``); 429 +
                                 Retry-After past registration.rate_per_s new
                                 workers, or registration.epochs_per_min new epochs
                                 at one URL (epoch_churn)
    POST /internal/v1/events     a ``radixfleet.wire.events`` batch -> ``radixfleet.index.feedback``
                                 (URL and epoch checked, sequence gaps, snapshots;
                                 applied in slices); its status word

Both are served on the data port (``radixfleet.server.front``: agents reach the router where
clients do), as handlers of an exchange whose body was read within the limits
(``exchange.peer()``: the peer's address and the listener's). A peer that hangs up
before its body has arrived (an agent timing out on an overloaded host) is one
counted log line (``hangup``: ``radixfleet_peer_hangups_total``), not a traceback.

Both sit behind the agent token (``auth.agent_token_env``); without one, they answer
only a loopback peer on a loopback listener (``RegistrationGuard.check_peer``).
With a bus, the same batches arrive from the stream instead (``radixfleet.bus.replica``)
and take the same ``Feedback.apply`` path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from radixfleet.common import jsonbody
from radixfleet.common.auth import BearerAuth
from radixfleet.config import Config, parse_worker_url
from radixfleet.fleet.pool import Pool
from radixfleet.fleet.registration import RegistrationGuard, UrlIsRouter
from radixfleet.index.feedback import Feedback
from radixfleet.index.prefix_index import COLDER_TIERS
from radixfleet.server.http_api import Answer, answered
from radixfleet.server.metrics import Metrics
from radixfleet.wire import events as ev
from radixfleet.wire.errors import (
    ConfigError,
    Conflict,
    Forbidden,
    MalformedRequest,
    Overloaded,
    RequestError,
    retry_after_header,
)

log = logging.getLogger("radixfleet.router")


#: event batches larger than this are parsed in a worker thread (see ``events``)
PARSE_IN_THREAD_BYTES = 256 * 1024


def _parse_batch(raw: bytes | bytearray) -> ev.EventBatch:
    return ev.parse_batch(jsonbody.loads(raw))


def _refusal(exc: RequestError) -> Answer:
    """A refused registration: its error body with ``status`` (the word agents read)."""
    headers = (
        (("Retry-After", retry_after_header(exc.retry_after_s)),) if exc.retry_after_s is not None else ()
    )
    return exc.status, {"status": exc.code, **exc.to_json()}, headers


class AgentHost(Protocol):
    """What the agent API reads and calls on the router (``radixfleet.server.app.Router``), read
    per request (a reload may replace ``cfg`` and ``agent_auth``)."""

    cfg: Config
    pool: Pool
    feedback: Feedback
    metrics: Metrics
    agent_auth: BearerAuth
    registration: RegistrationGuard

    def models_changed(self) -> None: ...


class AgentAPI:
    def __init__(self, host: AgentHost) -> None:
        self.host = host

    def routes(self, limits) -> dict:
        """POST path -> ``handler(exchange)``; the agent token is the caller's screen
        of the head (``Router.data_routes``), before the body is read."""
        return {
            ev.REGISTER_PATH: answered(self.register, limits),
            ev.EVENTS_PATH: answered(self.events, limits),
        }

    def hangup(self, method: str, path: str, remote: str | None) -> None:
        """A peer that hung up before its request was read: counted, one line."""
        self.host.metrics.peer_hangups.labels(path).inc()
        log.info(
            "agent API: %s %s from %s: the peer hung up before its request was read", method, path, remote
        )

    def _peer(self, ex, path: str) -> tuple | None:
        """The listener ``ex`` arrived on (its sockname), after the loopback rule of a
        tokenless agent API (``Forbidden`` off loopback)."""
        remote, local = ex.peer()
        h = self.host
        h.registration.check_peer(not h.agent_auth.token, remote, local, path)
        return local

    async def register(self, ex, raw: bytes | bytearray) -> Answer:
        h = self.host
        local = self._peer(ex, ev.REGISTER_PATH)
        reg = ev.parse_registration(jsonbody.loads(raw))
        try:
            url = parse_worker_url(reg.url, "url")
        except ConfigError as exc:
            raise MalformedRequest(str(exc), param="url") from None
        bb = reg.block_bytes
        ours = h.cfg.keys.block_bytes
        if bb is not None and bb != ours:
            # every hash it would report is one we never look up: refuse loudly
            h.metrics.registrations_refused.labels(reason=ev.STATUS_BLOCK_BYTES_MISMATCH).inc()
            log.warning(
                "refused registration of %s (%s): it hashes %d-byte blocks, this router keys.block_bytes=%d",
                reg.worker_id,
                url,
                bb,
                ours,
            )
            return (
                409,
                {
                    "status": ev.STATUS_BLOCK_BYTES_MISMATCH,
                    "block_bytes": ours,
                    "error": {
                        "message": f"agent block_bytes {bb} != router keys.block_bytes "
                        f"{ours}: start the agent with --block-bytes {ours} "
                        "(or change the router's keys.block_bytes)",
                        "type": "invalid_request_error",
                        "param": "block_bytes",
                        "code": ev.STATUS_BLOCK_BYTES_MISMATCH,
                    },
                },
                (),
            )
        try:
            # the guard counts and logs its own refusals
            await h.registration.check_url(
                reg.worker_id, url, h.cfg.registration, tokenless=not h.agent_auth.token, local=local
            )
        except (Forbidden, UrlIsRouter) as exc:
            return _refusal(exc)
        try:
            w = h.pool.register(
                reg.worker_id, url, reg.epoch, list(reg.models), bb, reg.role, reg.scheduling_policy
            )
        except (Conflict, Overloaded) as exc:
            h.metrics.registrations_refused.labels(reason=exc.code).inc()
            if isinstance(exc, Conflict):
                log.warning("refused registration of %s (%s): %s", reg.worker_id, url, exc.message)
            return _refusal(exc)
        h.models_changed()
        return 200, {"status": ev.STATUS_OK, "worker_id": w.id, "tiers": list(COLDER_TIERS)}, ()

    async def events(self, ex, raw: bytes | bytearray) -> Answer:
        self._peer(ex, ev.EVENTS_PATH)
        if len(raw) > PARSE_IN_THREAD_BYTES:
            # a large batch's parse (a 300,000-block snapshot: ~0.5 s) runs in a thread
            # that gives the GIL back every few ms, so the loop keeps serving meanwhile
            batch = await asyncio.to_thread(_parse_batch, raw)
        else:
            batch = _parse_batch(raw)
        status, word = await self.host.feedback.apply_async(batch, time.monotonic)
        return status, {"status": word}, ()
