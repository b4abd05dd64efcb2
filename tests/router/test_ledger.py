"""``radixfleet.server.ledger.RequestLedger``: every path from a pick to its end releases what the
pick counted exactly once, whatever order and repetition the hooks come in."""

from __future__ import annotations

import itertools
import random
import time
import types

import pytest

from radixfleet.config import parse_config
from radixfleet.engines.keyspace import SpaceKey
from radixfleet.keys import Endpoint
from radixfleet.route.core import Placement
from radixfleet.route.tenancy import Tenancy
from radixfleet.server.context import RequestContext
from radixfleet.server.ledger import LedgerParts, RequestLedger
from radixfleet.server.metrics import Metrics
from radixfleet.server.sse import StreamWatch
from tests.router.pools import make_pool

PROMPT, BLOCK = 300, 32


def placement(own: int = 200) -> Placement:
    return Placement(SpaceKey((1, 2, 3), PROMPT, BLOCK, False), 3, own, 0, None)


def ctx(ticket) -> RequestContext:
    """A client request as the ledger reads it: its ticket; no key (not logged)."""
    return RequestContext(
        None, Endpoint.CHAT, b"", {}, None, False, None, "r", time.monotonic(), ticket=ticket
    )


def setup(own: int = 200, tenancy: bool = False):
    pool, _, clock = make_pool()
    w = pool.get("a")
    pick = placement(own)
    pool.pick(w, pick.own, pick.key.prompt_tokens)  # what RouteCore.place counts
    metrics = Metrics()
    ten = ticket = None
    if tenancy:
        cfg = parse_config({"tenancy": {"tenants": {"t": {"tokens_per_min": 600000}}}}).tenancy
        ten = Tenancy(cfg, ["t"], metrics, clock())
        ticket = ten.admit("t", "", "m", {}, PROMPT, {"max_tokens": 10}, clock(), Endpoint.CHAT)
        ten.admitted(ticket, clock())
    led = RequestLedger(LedgerParts(pool, metrics, ten), w, pick, ctx(ticket), reason="test")
    return pool, w, led, metrics, ten, ticket


def counts(w) -> tuple[int, int, int]:
    return w.in_flight, w.in_flight_tokens, w.in_flight_kv


def sample(metrics: Metrics, name: str, **labels) -> float:
    v = metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_first_token_releases_the_prefill_and_the_end_the_rest():
    pool, w, led, m, _, _ = setup()
    assert counts(w) == (1, 200, PROMPT)
    led.first_byte(1.0)
    led.check()
    led.first_token(1.5)
    led.check()
    assert counts(w) == (1, 0, PROMPT)
    led.usage((PROMPT, 96), 7)
    assert led.end(True, 200, 2.0)
    led.check()
    assert counts(w) == (0, 0, 0)
    assert sample(m, "radixfleet_worker_requests_total", worker="a", model="", outcome="answered") == 1
    assert sample(m, "radixfleet_cached_tokens_total", worker="a", model="") == 96
    pool.check()


def test_an_end_without_a_first_token_releases_the_prefill_there():
    pool, w, led, _, _, _ = setup()
    led.end(True, 200, 2.0)
    led.check()
    assert counts(w) == (0, 0, 0)


@pytest.mark.parametrize("after_first_token", [False, True])
def test_cancel_releases_once_and_counts_the_client_gone(after_first_token):
    pool, w, led, m, _, _ = setup()
    if after_first_token:
        led.first_token(1.0)
    assert led.cancel(2.0)
    led.check()
    assert counts(w) == (0, 0, 0)
    assert sample(m, "radixfleet_worker_requests_total", worker="a", model="", outcome="gone") == 1
    assert sample(m, "radixfleet_requests_total", worker="a", status="200", reason="test") == 0


def test_hooks_after_the_end_do_nothing():
    pool, w, led, m, _, _ = setup()
    led.end(False, 502, 1.0)
    assert not led.end(True, 200, 2.0)
    assert not led.cancel(2.0)
    led.first_token(3.0)
    led.first_byte(3.0)
    led.usage((PROMPT, PROMPT), 1)
    led.check()
    assert counts(w) == (0, 0, 0)
    assert led.prompt_cached is None and led.ttft is None
    assert sample(m, "radixfleet_worker_requests_total", worker="a", model="", outcome="failed") == 1
    assert sample(m, "radixfleet_worker_requests_total", worker="a", model="", outcome="answered") == 0
    assert w.breaker_fails == 1  # the worker's failure counted once


def test_every_order_of_every_hook_releases_exactly_once():
    hooks = ["first_byte", "first_token", "usage", "end", "cancel", "end_fail"]
    rng = random.Random(7)
    orders = list(itertools.permutations(hooks, 4))
    rng.shuffle(orders)
    for order in orders[:200]:
        pool, w, led, _, _, _ = setup(own=rng.randint(0, 250))
        t = 1.0
        for h in order + tuple(rng.choice(hooks) for _ in range(3)):
            t += 0.1
            if h == "usage":
                led.usage((PROMPT, 32), 3)
            elif h == "end":
                led.end(True, 200, t)
            elif h == "end_fail":
                led.end(False, None, t)
            elif h == "cancel":
                led.cancel(t)
            else:
                getattr(led, h)(t)
            led.check()
            assert w.in_flight_tokens >= 0 and w.in_flight >= 0
        led.cancel(t + 1)  # the carrier's close, always
        assert counts(w) == (0, 0, 0), order
        pool.check()


def test_the_tenant_is_charged_what_the_engine_did_once():
    pool, w, led, m, ten, ticket = setup(tenancy=True)
    assert ticket.open
    led.first_token(1.0)
    led.usage((PROMPT, 0), 5)
    led.end(True, 200, 2.0)
    assert not ticket.open  # settled on usage: prompt + 5 tokens
    led.end(True, 200, 3.0)  # nothing charged twice
    assert not ticket.open


def test_an_end_that_tells_nothing_leaves_the_ticket_for_the_retry():
    pool, w, led, m, ten, ticket = setup(tenancy=True)
    led.end(False, None, 1.0)  # the pick could not be reached; another worker runs it
    assert ticket.open


def test_an_uncounted_leg_releases_its_load_and_tells_the_breaker_only():
    """A prefetch's warm-up or a P/D prefill leg: the pick's load and the worker's
    breaker, nothing counted, charged or learned."""
    pool, _, clock = make_pool()
    w = pool.get("a")
    pick = placement()
    pool.pick(w, pick.own, pick.key.prompt_tokens)
    m = Metrics()
    led = RequestLedger(LedgerParts(pool, m), w, pick, counted=False)
    led.first_byte(1.0)
    led.usage((PROMPT, 0), 1)
    assert led.end(False, 200, 2.0)
    led.check()
    assert counts(w) == (0, 0, 0)
    assert w.breaker_fails == 1
    for outcome in ("answered", "failed", "gone"):
        assert sample(m, "radixfleet_worker_requests_total", worker="a", model="", outcome=outcome) == 0
    assert sample(m, "radixfleet_requests_total", worker="a", status="200", reason="") == 0
    assert led.quality is None
    pool.check()


def test_a_route_counts_the_attempts_quality_at_its_end():
    pool, w, _, m, _, _ = setup()
    route = types.SimpleNamespace(available_tokens=3 * BLOCK)  # what quality() reads
    led = RequestLedger(LedgerParts(pool, m), w, placement(), route=route)
    led.usage((PROMPT, 2 * BLOCK))
    led.check()
    assert led.quality is None  # none before the end
    led.end(True, 200, 2.0)
    led.check()
    assert led.quality == (3 * BLOCK, 3 * BLOCK, 2 * BLOCK)
    assert sample(m, "radixfleet_available_cached_tokens_total", worker="a", model="") == 3 * BLOCK


def test_a_head_that_is_no_answer_is_timed_not_observed():
    pool, w, led, m, _, _ = setup()
    led.first_byte(1.0, counted=False)
    led.first_byte(2.0)  # once
    led.check()
    assert led.head == 1.0 and led.ttfb is None
    assert m.registry.get_sample_value("radixfleet_ttfb_seconds_count") in (None, 0.0)


def test_a_broken_stream_counts_a_502_and_logs_what_the_client_got():
    pool, w, _, m, _, _ = setup()
    led = RequestLedger(LedgerParts(pool, m), w, placement(), ctx(None), reason="test")
    led.stream(StreamWatch(False))
    led.first_token(1.0)
    led.end(False, 200, 2.0, broken=True)
    led.check()
    assert led.status == 200 and led.broken
    assert sample(m, "radixfleet_requests_total", worker="a", status="502", reason="test") == 1
    assert sample(m, "radixfleet_requests_total", worker="a", status="200", reason="test") == 0
