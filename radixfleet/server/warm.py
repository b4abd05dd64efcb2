"""What the data plane sends a worker that no client waits on: ``Warmer``.

Hot-root warm-ups (radixfleet.route.warmup): a prefill-only request of a hot prefix to each new
replica the policy named, at most one per (worker, prefix) per
``warmup.min_interval_s``. Prefetches (``POST /v1/prefetch``, radixfleet.server.prefetch): the
body keyed and routed like the real request, its worker hinted and sent the prompt
with ``max_tokens: 1``; its load counted at the pick is released through an
uncounted ledger (radixfleet.server.ledger: the breaker told, nothing else). Both answers are
read and dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from radixfleet.common import jsonbody
from radixfleet.keys import Endpoint, request_key
from radixfleet.route.core import Reject, Route, uncached_tokens
from radixfleet.route.warmup import WarmupGate, warmup_prefix
from radixfleet.server import edge, screen
from radixfleet.server.answers import JSON, REQUEST_ID_HEADER, WORKER_HEADER
from radixfleet.server.ledger import RequestLedger
from radixfleet.wire.errors import MalformedRequest, NotFound, Overloaded, RequestError
from radixfleet.wire.identifiers import request_id

if TYPE_CHECKING:
    from radixfleet.fleet.pool import Worker
    from radixfleet.route.core import Placement

log = logging.getLogger("radixfleet.router")

#: a prefetch as tenancy.admit reads its body: the warm-up it sends generates one token
WARM_UP: dict[str, Any] = {"max_tokens": 1}


class Warmer:
    """The warm-ups and prefetches of the data plane that owns it (module docstring)."""

    __slots__ = ("dp", "_warmed")

    def __init__(self, dp: Any) -> None:
        #: the ``radixfleet.server.dataplane.DataPlane`` that owns it (not imported: it imports this)
        self.dp = dp
        self._warmed = WarmupGate()  # hot-root warm-ups sent (radixfleet.route.warmup)

    def schedule(self, workers, endpoint, body, key, depth, now) -> None:
        """Prefill-only warm-ups of a hot root's new replicas (byte space: the routing
        bytes of the matched prefix), at most one per (worker, prefix) per
        ``warmup.min_interval_s`` (radixfleet.route.warmup, the simulator's gate too)."""
        dp = self.dp
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
        interval = dp.cfg.warmup.min_interval_s
        payload = None
        for wid in workers:
            w = dp.pool.get(wid)
            if w is None or not self._warmed.admit(wid, h, now, interval):
                continue
            if payload is None:
                warm = {"model": key.model, "prompt": prompt, "max_tokens": 1, "stream": False}
                for f in ("lora_path", "lora_adapter"):  # the adapter's cache, not the base's
                    if body.get(f) is not None:
                        warm[f] = body[f]
                payload = json.dumps(warm).encode()
            dp._spawn(self._warmup(w, payload, key.tenant))

    async def _warmup(self, w: Worker, payload: bytes, tenant: str) -> None:
        dp = self.dp
        rid = f"{dp._rid_prefix}-warm-{next(dp._rid)}"
        status = await self.prefill_only(
            w,
            Endpoint.COMPLETIONS,
            payload,
            dp.tenants.forward_headers(tenant),
            rid,
            dp.cfg.warmup.timeout_s,
        )
        dp.metrics.warmups.labels("ok" if status is not None and status < 400 else "error").inc()

    async def prefill_only(
        self, w: Worker, endpoint: Endpoint, payload: bytes, headers: dict, rid: str, timeout_s: float
    ) -> int | None:
        """Sends ``w`` a prefill-only request (``max_tokens: 1``, not streamed: a
        hot-root warm-up or a prefetch) and drops its answer. Returns the worker's
        status, or None when it did not answer (logged)."""
        dp = self.dp
        assert dp.session is not None, "warm-ups and prefetches run only once started"
        try:
            async with dp.session.post(
                w.url + endpoint.value,
                data=payload,
                headers={"Content-Type": JSON, **headers, REQUEST_ID_HEADER: rid},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                await resp.read()
                if resp.status >= 400:
                    log.debug("prefill-only request %s on %s: HTTP %d", rid, w.id, resp.status)
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.debug("prefill-only request %s on %s failed: %r", rid, w.id, exc)
            return None

    async def prefetch(self, ex) -> None:
        """``POST /v1/prefetch`` (radixfleet.server.prefetch): the body of a chat or completion
        request (or its prefix) is keyed and routed like the real one, its worker
        hinted and sent the prompt with ``max_tokens: 1``; the client gets 202 at
        once. Refused, nothing warmed: 400 malformed, 404/503 no worker serves the
        model, 429 (+ Retry-After) when the router or fleet is loaded or the budget
        is spent or the tenant (or key) is over its rate limit. Takes no admission
        slot; charged to the tenant's and key's limits as the warm-up request it
        sends (radixfleet.server.prefetch, "Tenant limits")."""
        dp = self.dp
        t0 = time.monotonic()
        headers = ex.headers
        rid = request_id(headers.get(REQUEST_ID_HEADER)) or f"{dp._rid_prefix}-pf-{next(dp._rid)}"
        pcfg = dp.cfg.prefetch
        try:
            if not pcfg.enabled:
                raise NotFound("prefetch is turned off on this router (prefetch.enabled)")
            raw = await ex.body(dp.cfg.limits.max_body_bytes)
            screen.check_raw(dp.pool, raw, time.monotonic())  # radixfleet.server.screen
            body = jsonbody.loads(raw)
            if not isinstance(body, dict):
                raise MalformedRequest("the body must be a JSON object")
            edge.check_request(body)
            if "messages" in body:
                endpoint = Endpoint.CHAT
            elif "prompt" in body:
                endpoint = Endpoint.COMPLETIONS
            else:
                raise MalformedRequest(
                    "a prefetch is the body of a chat ('messages') or completion ('prompt') request",
                    param="messages",
                )
            tenant, api_key = dp.tenants.identify(headers)
            screen.check_parsed(dp.pool, endpoint, body, time.monotonic())
            ns = dp.tenants.namespace_of(tenant)
            key = request_key(endpoint, body, tenant=ns, block_bytes=dp.cfg.keys.block_bytes)
            session = headers.get("x-session-id")
            if session is None and isinstance(body.get("user"), str):
                session = body["user"]
            now = time.monotonic()
            self.sweep(now)
            await dp._prepare_keys(endpoint, body, key)
            now = time.monotonic()
            # charged as the request it sends: one, and its prompt plus the one token
            # it generates (radixfleet.server.prefetch, "Tenant limits"); 429 when over; dropped
            # first when a real request would wait or be shed (radixfleet.route.core)
            # (tenancy reads the warm-up's body, the keyer the client's)
            ask = dp.ask_of(endpoint, body, key, session, tenant, api_key, headers).again(
                body=WARM_UP, endpoint=Endpoint.CHAT, split=False, prefetch=True, place=False
            )
            routed = dp.route.decide(ask, now)
            if isinstance(routed, Reject):
                if routed.ticket is not None:
                    dp.tenancy.refund(routed.ticket, now)
                if routed.shed:
                    dp.metrics.prefetch_dropped.labels("load").inc()
                raise routed.error
            assert isinstance(routed, Route)  # a prefetch is never held nor split
            ticket = routed.ticket
            assert ticket is not None  # the data plane always has its tenancy stage
            w, kr = routed.worker, routed.keyed
            sk = kr.key_for(w.id)
            held = kr.blocks_for(w.id)
            dedup = not sk.hashes or held >= len(sk.hashes)
            tokens = 0
            if not dedup:
                tokens = uncached_tokens(sk.prompt_tokens, held, sk.block_tokens)
                rate = pcfg.share * sum(x.prefill_rate(now) for x in dp.pool.routable_workers(now))
                wait = dp.prefetch_budget.take(tenant, tokens, rate, pcfg.burst_s, now)
                if wait is not None:  # nothing warmed, the reservation given back
                    dp.tenancy.refund(ticket, now)
                    dp.metrics.prefetch_dropped.labels("budget").inc()
                    raise Overloaded(
                        f"the prefetch budget ({pcfg.share:g} of the fleet's prefill) is spent",
                        retry_after_s=max(1.0, min(wait, 60.0)),
                    )
        except RequestError as exc:
            dp._reject(ex, exc, rid)
            return
        m = dp.metrics
        dp.tenancy.admitted(ticket, now)
        # the answer tells a client without an identity nothing of what others sent
        # (radixfleet.server.prefetch, "What the answer says"): charged alike, no flag
        told = not dp.tenants.anonymous(tenant)
        if dedup:
            m.prefetch.labels("deduplicated").inc()
            if told:
                dp.tenancy.settle(ticket, 0, now)  # nothing sent: its tokens given back
        else:
            pick = dp.route.place(w, kr, now)  # the hint the real request follows; its load
            link = w.engine
            holder = w.id if pick.rank is None or link is None else link.holder(pick.rank)
            # its last full block may hold the chat template's closing tokens, which the
            # real request (its message goes on) does not share: the one before marks it
            mark = sk.hashes[-2] if len(sk.hashes) > 1 else sk.hashes[-1]
            wasted = dp.prefetched.warmed(w.id, mark, now, holder)
            if wasted:
                m.prefetch.labels("unused").inc(wasted)
            m.prefetch.labels("warmed").inc()
            m.prefetch_tokens.inc(tokens)
            dp._spawn(self._send(w, pick, endpoint, body, key.tenant, rid, ticket.rank))
        out: dict[str, Any] = {"object": "prefetch", "accepted": True}
        if told:
            out["deduplicated"] = dedup
        extra = [(REQUEST_ID_HEADER, rid), *ticket.headers()]
        if dp.cfg.response_headers.worker_id:
            out["worker"] = w.id
            extra.insert(0, (WORKER_HEADER, w.id))
        ex.reply(202, json.dumps(out).encode(), JSON, extra)
        m.observe_latency(time.monotonic() - t0)

    async def _send(
        self, w: Worker, pick: Placement, endpoint: Endpoint, body: dict, tenant: str, rid: str, rank: int
    ) -> None:
        """The prefetch's prefill on ``w``: the client's body with ``max_tokens: 1``,
        not streamed, its ``priority`` the class's (``rank``) as any request's, its
        answer discarded; the load counted at the pick released on every path (an
        uncounted ledger: radixfleet.server.ledger)."""
        dp = self.dp
        warm = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        warm.update(max_tokens=1, stream=False, n=1)
        headers = dp.tenants.forward_headers(tenant)
        if pick.rank is not None:
            headers = {**headers, "x-data-parallel-rank": str(pick.rank)}
        led = RequestLedger(dp.parts, w, pick, counted=False)
        ok: bool | None = None  # cancelled (shutdown): neither
        try:
            payload, _ = dp.engines.forward_body(
                led.link, endpoint, warm, json.dumps(warm).encode(), False, rank
            )
            status = await self.prefill_only(
                w, endpoint, bytes(payload), headers, rid, dp.cfg.prefetch.timeout_s
            )
            if status is not None and status < 400:
                ok = True
            elif status != 429:  # busy is not broken
                ok = False
        finally:
            led.end(ok, None, time.monotonic())  # its load released, the breaker told
            if ok is not True:
                dp.metrics.prefetch.labels("failed").inc()

    def used(self, w: Worker, pick: Placement, now: float) -> None:
        """A real request picked ``w``: the prefetches of a prefix it matched there
        were used."""
        dp = self.dp
        used = dp.prefetched.observe(w.id, pick.key.hashes[: pick.blocks])
        if used:
            dp.metrics.prefetch.labels("used").inc(used)
        self.sweep(now)

    def sweep(self, now: float) -> None:
        """Counts the prefetches past ``prefetch.window_s`` as wasted."""
        dp = self.dp
        tt = dp.index.touch_time
        evicted, unused = dp.prefetched.sweep(
            now, dp.cfg.prefetch.window_s, lambda holder, h: tt(holder, h) is not None
        )
        if evicted:
            dp.metrics.prefetch.labels("evicted").inc(evicted)
        if unused:
            dp.metrics.prefetch.labels("unused").inc(unused)
