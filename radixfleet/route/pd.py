"""Disaggregated prefill/decode on the live data plane: a request's two legs.

A model whose routable workers include ``role: prefill`` ones (``radixfleet.policies.disagg``)
is served in two legs, vLLM's protocol (its disaggregated-serving proxy and
``kv_transfer_params``, the NIXL/P2P connectors' contract)::

    prefill worker  <- the client's body with max_tokens 1, stream false and
                       kv_transfer_params {do_remote_decode: true, do_remote_prefill:
                       false, remote_engine_id/block_ids/host/port: null}
                    -> its answer's kv_transfer_params (engine id, block ids, host,
                       port of the KV it holds for the decode side to pull)
    decode worker   <- the client's own body (streamed or not) plus those params;
                       its answer (stream, usage) goes to the client as it comes

Choices. The prefill worker is the router's policy pick among the prefill workers
(the prefix index lives on the prefill side: prefix_load's match against queue is
the prefix-aware choice), hinted and load-counted as any pick. The decode worker is
``radixfleet.policies.disagg.choose_decode`` among the ``decode`` and ``both`` workers: room for
the prompt plus ``max_tokens`` of KV, then the fewest running + queued requests, then
the most of the prompt already held there (the least KV to transfer).

Skipping the prefill pool. The decode worker is chosen first; a request whose
uncached part *there* (the prompt minus what the index says that worker holds: a
decode worker keeps the KV of what it decoded, so a conversation's next turn is
mostly cached on it) is below ``disagg.colocate_below_tokens`` runs colocated on it:
shipping its KV would cost more than computing it there. The default (-1) derives
the threshold from the learned prefill rate: the tokens that decode worker prefills
(``Worker.prefill_rate``, learned from its answers) in ``disagg.decode_step_s`` (25
ms, a stated constant, a typical decode step of a loaded batch): a colocated prefill
shorter than one decode step stalls its batch by less than a step.

Failures. The prefill leg generates one token the client never sees: one that fails
(refused, broken, 5xx, timed out) has started no decode and may run on another
prefill worker (``disagg.prefill_attempts``); its 4xx is the client's and answered as
such. A prefill answer without ``kv_transfer_params`` (a worker without a connector)
leaves the decode worker to prefill the prompt itself. The decode leg follows the
data plane's rules (``radixfleet.server.dataplane``): it moves to another decode worker only
when provably not started, never once a byte reached the client. No decode worker
available (none routable, or none left once the prefill leg is done): 503 with
``Retry-After`` (a health interval), and no decode leg. A client gone
cancels the leg in flight (its connection closed: the engine aborts it).

SGLang's protocol, when the chosen prefill worker is an SGLang one (``kind: sglang``
or probed so): both legs at once, each the client's body plus ``bootstrap_host`` (the
prefill worker's host), ``bootstrap_port`` (its ``bootstrap_port`` setting, SGLang's
``--disaggregation-bootstrap-port``) and a random 63-bit ``bootstrap_room`` that pairs
them; the prefill leg is not streamed and its answer dropped, the decode leg's goes to
the client. The room binds the pair: neither leg moves to another worker, and the
prefill leg is cancelled once the decode leg is done or the client gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from radixfleet.engines.adapters import PdLeg
from radixfleet.keys import Endpoint
from radixfleet.policies.base import Decision, Reason, WorkerView
from radixfleet.policies.disagg import BOTH, DECODE, PREFILL, choose_decode
from radixfleet.route.core import Ask, Route
from radixfleet.route.tenancy import PRIORITIES
from radixfleet.server.ledger import RequestLedger
from radixfleet.server.upstream import Cancel, UpstreamError, build_head, finish_outcome
from radixfleet.wire.errors import NoWorkerAvailable

if TYPE_CHECKING:
    from radixfleet.engines.keyspace import KeyedRequest
    from radixfleet.fleet.pool import Worker

log = logging.getLogger("radixfleet.router")

#: what a prefill leg asks for: vLLM's proxy sends exactly these
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict) -> dict:
    """The prefill leg's body: the client's, one token, not streamed, asking the
    engine to keep the KV for a remote decode."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def max_tokens_of(body: dict) -> int:
    """The tokens a request may generate, as far as its body says (0: not said)."""
    for k in ("max_completion_tokens", "max_tokens"):
        v = body.get(k)
        if type(v) is int and v > 0:
            return v
    return 0


class _PrefillFailed(Exception):
    """One prefill leg failed (``status``: the worker's, if it answered one)."""

    def __init__(self, message: str, status: int | None = None, data: bytes | bytearray = b"") -> None:
        super().__init__(message)
        self.status = status
        self.data = bytes(data)


class PrefillDecode:
    """The two-leg path of the data plane that owns it (module docstring)."""

    def __init__(self, dp: Any) -> None:
        #: the ``radixfleet.server.dataplane.DataPlane`` that owns it (not imported: it imports this)
        self.dp = dp
        self.rng = random.Random()

    def _role(self, v: WorkerView) -> str:
        w = self.dp.pool.get(v.id)
        return w.role if w is not None else BOTH

    def disaggregated(self, views: Sequence[WorkerView]) -> bool:
        """Whether a request over ``views`` takes the two-leg path: some are not
        colocated (``both``) workers."""
        pool = self.dp.pool
        if not pool.disaggregated():
            return False
        for v in views:
            w = pool.get(v.id)
            if w is not None and w.spec is not None and w.spec.role != BOTH:
                return True
        return False

    def _is_prefill(self, v: WorkerView) -> bool:
        return self._role(v) == PREFILL

    def _is_decode(self, v: WorkerView) -> bool:
        return self._role(v) in (DECODE, BOTH)

    def _decode_choice(self, need: int, first: Decision | None):
        """The decode leg's chooser: ``first`` for its first try (when already made),
        then ``choose_decode`` among those left."""
        pending = [first] if first is not None else []

        def choose(kr: KeyedRequest, views: list[WorkerView], now: float) -> Decision:
            if pending:
                return pending.pop()
            return Decision(choose_decode(views, need, self.rng, kr.held_tokens).id, Reason.LEAST_LOAD)

        return choose

    def threshold(self, w: Worker, now: float) -> int:
        """Uncached tokens (on decode worker ``w``) below which a request skips the
        prefill pool (module docstring)."""
        dc = self.dp.cfg.disagg
        if dc.colocate_below_tokens >= 0:
            return dc.colocate_below_tokens
        return int(w.prefill_rate(now) * dc.decode_step_s)

    def _no_decode(self, ctx: Any, when: str) -> None:
        """503 with ``Retry-After`` (a health interval: when a decode worker may be back)."""
        dp = self.dp
        dp.metrics.pd_no_decode.labels("after_prefill" if when else "before").inc()
        msg = f"no decode worker for model {ctx.key.model!r} is available"
        dp._reject(
            ctx.ex,
            NoWorkerAvailable(f"{msg} {when}" if when else msg, retry_after_s=dp.cfg.health.interval_s),
            ctx.rid,
        )

    async def serve(self, ctx: Any, kr: KeyedRequest, views: list[WorkerView], now: float) -> None:
        dp = self.dp
        prefill = [v for v in views if self._role(v) == PREFILL]
        decode = [v for v in views if self._is_decode(v)]
        if not decode:
            self._no_decode(ctx, "")
            return
        req = kr.route_request
        need = req.prompt_tokens + max_tokens_of(ctx.body)
        dv = choose_decode(decode, need, self.rng, kr.held_tokens)
        first: Decision | None = Decision(dv.id, Reason.LEAST_LOAD)
        dw = dp.pool.get(dv.id)
        assert dw is not None, "a view names a worker of the pool"
        uncached = max(0, kr.key_for(dw.id).prompt_tokens - kr.held_tokens(dw.id))
        # vLLM's protocol is the OpenAI API's: SGLang's native /generate runs colocated
        openai = ctx.endpoint is not Endpoint.GENERATE
        if prefill and openai and uncached >= self.threshold(dw, now):
            # the policy's pick among the prefill workers, placed when its leg is sent
            leg = dp.ask_for(ctx).admit(ctx.ticket, eligible=self._is_prefill, split=False, place=False)
            routed = dp.route.route(leg, prefill, kr, ctx.ticket, now)
            assert isinstance(routed, Route)  # split=False: never Admitted
            pw = routed.worker
            if pw.engine is not None and pw.engine.adapter.pd_leg is PdLeg.BOOTSTRAP:
                dp.metrics.pd_legs.labels("prefill").inc()
                await self._sglang(ctx, kr, pw, first, need)
                return
            params = await self._prefill(ctx, routed, leg)
            if params is None:
                return  # answered (its failure)
            if params:
                body = {**ctx.body, "kv_transfer_params": params}
                ctx = dataclasses.replace(ctx, body=body, raw=json.dumps(body).encode())
            dp.metrics.pd_legs.labels("prefill").inc()
            # the decode choice again, on what the pool knows now: the leg took time
            now = time.monotonic()
            decode = [v for v in dp.pool.views(now, ctx.key.model, ctx.key.adapter) if self._is_decode(v)]
            if not decode:  # gone during the prefill leg: no decode has started
                self._no_decode(ctx, "after its prefill leg")
                return
            first = None
        else:
            dp.metrics.pd_legs.labels("colocated").inc()
        await self._decode(ctx, kr, decode, now, self._decode_choice(need, first), self._is_decode)

    async def _decode(
        self,
        ctx: Any,
        kr: KeyedRequest,
        decode: list[WorkerView],
        now: float,
        choose: Callable[[KeyedRequest, Sequence[WorkerView], float], Decision],
        eligible: Callable[[WorkerView], bool],
    ) -> None:
        """The decode leg: ``choose`` among ``decode`` through the route core (placed
        there), forwarded by the data plane; a retry asks the core again among the
        ``eligible`` workers left."""
        dp = self.dp
        ask = dp.ask_for(ctx).admit(ctx.ticket, choose=choose, eligible=eligible, split=False)
        routed = dp.route.route(ask, decode, kr, ctx.ticket, now)
        assert isinstance(routed, Route)  # split=False: never Admitted
        dp.routed(ctx, routed, now)
        await dp.attempts.forward(ctx, routed, ask, now)

    async def _sglang(
        self, ctx: Any, kr: KeyedRequest, pw: Worker, first: Decision | None, need: int
    ) -> None:
        """SGLang's two legs at once, paired by a bootstrap room (module docstring)."""
        dp = self.dp
        host, _, _ = dp.attempts.addr(pw.url)
        assert pw.spec is not None, "a worker with an engine link has its entry"
        body = {
            **ctx.body,
            "bootstrap_host": host,
            "bootstrap_port": pw.spec.bootstrap_port,
            "bootstrap_room": self.rng.getrandbits(63),
        }
        raw = json.dumps(body).encode()
        leg_body = {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False}
        rank = ctx.ticket.rank if ctx.ticket is not None else None
        # its priority the class's, in the prefill engine's order, as the decode leg's
        leg, _ = dp.engines.forward_body(
            pw.engine, ctx.endpoint, leg_body, json.dumps(leg_body).encode(), False, rank
        )
        prefill = asyncio.ensure_future(self._prefill_leg(ctx, kr, pw, bytes(leg), room=True))
        try:
            ctx = dataclasses.replace(ctx, body=body, raw=raw)
            now = time.monotonic()
            decode = [v for v in dp.pool.views(now, ctx.key.model, ctx.key.adapter) if self._is_decode(v)]
            # the room binds this pair: the decode leg goes nowhere else
            await self._decode(ctx, kr, decode, now, self._decode_choice(need, first), lambda v: False)
        finally:
            if not prefill.done():
                prefill.cancel()
            try:
                await prefill
            except (asyncio.CancelledError, _PrefillFailed) as exc:
                if isinstance(exc, _PrefillFailed):
                    log.warning("request %s: SGLang prefill worker %s failed (%s)", ctx.rid, pw.id, exc)

    async def _prefill(self, ctx: Any, routed: Route, leg: Ask) -> dict[str, Any] | None:
        """Runs the prefill leg on ``routed``'s worker, and after a failure on another
        prefill worker (the route core asked again, those tried excluded). Returns
        its answer's ``kv_transfer_params`` ({} when it gave none), or None once the
        client has been answered (a 4xx, or every attempt failed). A worker that
        schedules by priority gets the class as the decode leg's does (``forward_body``)."""
        dp = self.dp
        body = prefill_body(ctx.body)
        payload = json.dumps(body).encode()
        rank = PRIORITIES.index(ctx.ticket.priority) if ctx.ticket is not None else None
        tried: list[str] = []
        last: _PrefillFailed | None = None
        attempts = dp.cfg.disagg.prefill_attempts
        while True:
            w = routed.worker
            tried.append(w.id)
            try:
                out, _ = dp.engines.forward_body(w.engine, ctx.endpoint, body, payload, False, rank)
                t = time.monotonic()
                params = await self._prefill_leg(ctx, routed.keyed, w, bytes(out))
                dp.metrics.pd_prefill.observe(time.monotonic() - t)
                return params
            except _PrefillFailed as exc:
                if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
                    dp.attempts.answer_error(ctx, w.id, exc.status, exc.data, [])
                    return None
                last = exc
                dp.metrics.attempt(w.id, str(exc.status or "prefill"))
                log.warning(
                    "request %s: prefill worker %s failed (%s), attempt %d/%d",
                    ctx.rid,
                    w.id,
                    exc,
                    len(tried),
                    attempts,
                )
            now = time.monotonic()
            if len(tried) >= attempts or now - ctx.t0 >= dp.cfg.timeouts.total_s:
                break
            again = dp.route.decide(leg.again(exclude=frozenset(tried)), now)
            if not isinstance(again, Route):  # no prefill worker left
                break
            routed = again
        status = last.status if last is not None and last.status in (429, 503) else 502
        dp.attempts.answer_error(ctx, tried[-1], status, b"", [])
        return None

    async def _prefill_leg(
        self, ctx: Any, kr: KeyedRequest, w: Worker, payload: bytes, *, room: bool = False
    ) -> dict[str, Any]:
        """One prefill leg on ``w``: the pick's hint and load count, the request,
        the load released on every path (an uncounted ledger: radixfleet.server.ledger).
        ``room``: an SGLang leg (its answer is not read for params)."""
        dp = self.dp
        pick = dp.route.place(w, kr, time.monotonic())
        led = RequestLedger(dp.parts, w, pick, counted=False)  # not the client's answer
        host, port, hostport = dp.attempts.addr(w.url)
        fwd = (
            dp.tenants.forward_lines(ctx.key.tenant)
            + b"x-request-id: "
            + ctx.rid.encode("utf-8", "surrogateescape")
            + b"-prefill\r\n"
        )
        if pick.rank is not None:
            fwd += b"x-data-parallel-rank: %d\r\n" % pick.rank
        fwd += dp.hops.lines(ctx.ex.headers)  # radixfleet.server.hops
        trace, span = ctx.trace, 0
        if trace is not None:  # the prefill engine's spans join this leg's
            span, lines = trace.attempt()
            fwd += lines
        head = build_head(ctx.endpoint.value, hostport, len(payload), fwd)
        ok: bool | None = False
        resp = None
        cancel = Cancel()
        dp.attempts.watch(w, cancel)
        try:
            assert dp.upstream is not None, "the data plane serves only once started"
            try:
                resp = await dp.upstream.request(
                    host,
                    port,
                    head,
                    payload,
                    read_timeout_s=float("inf"),
                    total_timeout_s=dp.cfg.timeouts.total_s - (time.monotonic() - ctx.t0),
                    cancel=cancel,
                )
                data = await resp.read()
            except UpstreamError as exc:
                ok = finish_outcome(exc)  # the router's own deadline or limit: not w's fault
                if exc.cause == "connect":
                    dp.pool.check_soon(w)
                raise _PrefillFailed(f"{exc.cause}: {exc}") from None
            if resp.status != 200:
                # a 5xx failed; 429 is busy, not broken; a 4xx is the request's
                ok = False if resp.status >= 500 else (True if resp.status == 429 else None)
                raise _PrefillFailed(f"answered {resp.status}", resp.status, data)
            try:
                obj = json.loads(data)
            except ValueError:
                raise _PrefillFailed("answered 200 without JSON") from None
            ok = True
            handoffs = dp.metrics.pd_handoffs
            if room:
                handoffs.labels("bootstrap").inc()
                return {}
            params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
            if not isinstance(params, dict):
                handoffs.labels("none").inc()
                log.info("request %s: prefill worker %s gave no kv_transfer_params", ctx.rid, w.id)
                return {}
            handoffs.labels("params").inc()
            return params
        finally:
            dp.attempts.unwatch(w, cancel)
            if resp is not None:
                resp.release()
            led.end(ok, None, time.monotonic())  # its load released, the breaker told
            if trace is not None:
                status = resp.status if resp is not None else None
                trace.attempt_end(span, w.id, led.sent, None, None, status, ok, None, None, leg="prefill")
