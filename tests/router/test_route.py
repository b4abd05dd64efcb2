"""The route core (radixfleet/route/core.py): each verdict, what it counted, and what a retry,
a prefetch and a disaggregated fleet's first decision get — with the live pool, index,
policies and shedder, no I/O."""

from __future__ import annotations

import random

import pytest

from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.policies.base import Decision, Reason
from radixfleet.policies.registry import build_policy
from radixfleet.route.core import Admitted, Ask, Hold, Reject, Route, RouteCore, RouteParts
from radixfleet.wire.errors import MalformedRequest, Overloaded, RateLimited
from tests.router.pools import make_pool

HASHES = (11, 12, 13, 14)
BLOCK_TOKENS = 32
PROMPT = 4 * BLOCK_TOKENS + 10


def keyer(hashes=HASHES, prompt=PROMPT):
    """The request keyed in one byte space and matched in ``index``."""
    from radixfleet.policies.base import RouteRequest

    def key(views, now, index):
        req = RouteRequest(hashes, prompt, BLOCK_TOKENS, None, "m", prompt * 4)
        m = index.match(hashes, now, True)
        return KeyedRequest.single(("bytes", 128), SpaceKey(hashes, prompt, BLOCK_TOKENS, False), req, m)

    return key


class Refuse:
    """A shedder whose every fleet is saturated (records each check)."""

    def __init__(self) -> None:
        self.checks: list[int] = []

    def check(self, workers, model, adapter, uncached, now, scale=1.0, *, prefetch=False):
        self.checks.append(uncached)
        return Overloaded("saturated", retry_after_s=1)


class Queue:
    """An admission queue that is on."""

    class cfg:
        max_wait_s = 1.0


def core(policy="round_robin", **parts):
    pool, index, clock = make_pool(policy={"name": policy})
    pol = build_policy(policy, {}, random.Random(0), path="policy")
    return RouteCore(RouteParts(pool, index, pol, **parts)), pool, index, clock


def ask(index, **kw):
    k = keyer()
    return Ask(lambda views, now: k(views, now, index), "m", **kw)


def test_a_route_is_chosen_hinted_and_counted_before_it_returns():
    c, pool, index, clock = core("cache_aware")
    index.insert("b", HASHES[:2], clock.t)  # b holds the first two blocks
    v = c.decide(ask(index), clock.t)
    assert isinstance(v, Route)
    assert v.worker.id == "b" and v.decision.matched_blocks == 2
    p = v.placement
    assert p is not None and p.blocks == 2 and p.own == PROMPT - 2 * BLOCK_TOKENS
    # the load is on b at once, and b is hinted as holding the whole prompt
    assert pool.get("b").in_flight_tokens == p.own and pool.get("a").in_flight_tokens == 0
    assert index.match(HASHES, clock.t, False).blocks == {"b": 4}
    index.check()


def test_no_worker_left_is_a_refusal_that_keys_and_counts_nothing():
    c, pool, index, clock = core()
    gone = Ask(lambda views, now: pytest.fail("keyed without views"), "m", exclude=frozenset({"a", "b"}))
    v = c.decide(gone, clock.t)
    assert isinstance(v, Reject) and v.error.status == 503 and not v.shed
    assert all(w.in_flight == 0 for w in pool)


def test_a_body_the_key_space_refuses_is_a_400_refusal():
    c, pool, index, clock = core()

    def bad(views, now):
        raise MalformedRequest("no", param="prompt")

    v = c.decide(Ask(bad, "m"), clock.t)
    assert isinstance(v, Reject) and v.error.status == 400
    assert index.match(HASHES, clock.t, False).blocks == {}


def test_the_shedder_refuses_with_the_requests_uncached_tokens_and_counts_nothing():
    shed = Refuse()
    c, pool, index, clock = core(shedder=shed)
    index.insert("a", HASHES[:1], clock.t)
    v = c.decide(ask(index), clock.t)
    assert isinstance(v, Reject) and v.shed and v.error.status == 429
    assert shed.checks == [PROMPT - BLOCK_TOKENS]  # the best match's uncached part
    assert all(w.in_flight == 0 for w in pool)
    assert index.match(HASHES, clock.t, False).blocks == {"a": 1}  # no hint


def test_an_admitted_request_is_not_shed_again_on_its_retry_and_avoids_the_tried():
    shed = Refuse()
    c, pool, index, clock = core(shedder=shed)
    first = c.decide(ask(index, ticket=None), clock.t)
    assert isinstance(first, Reject)
    # a retry (or a request the queue let in) carries its ticket: no admission chain
    retry = ask(index).admit(None, exclude=frozenset({"a"}))
    v = c.decide(retry, clock.t)
    assert isinstance(v, Route) and v.worker.id == "b"
    assert len(shed.checks) == 1
    # every worker excluded: nothing left to route to
    none = c.decide(retry.again(exclude=frozenset({"a", "b"})), clock.t)
    assert isinstance(none, Reject) and none.error.status == 503


class Ticket:
    scale = 1.0
    priority = "standard"


class Tenancy:
    """The tenancy stage's interface: ``admit`` a ticket, or raise its refusal."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.tickets: list[Ticket] = []

    def admit(self, tenant, key, model, headers, prompt_tokens, body, now, endpoint):
        if self.refuse:
            raise RateLimited("over the limit", retry_after_s=2)
        self.tickets.append(Ticket())
        return self.tickets[-1]


def test_over_a_rate_limit_is_a_refusal_before_the_shedder_is_asked():
    shed = Refuse()
    c, pool, index, clock = core(shedder=shed, tenancy=Tenancy(refuse=True))
    v = c.decide(ask(index), clock.t)
    assert isinstance(v, Reject) and v.error.status == 429 and not v.shed and v.ticket is None
    assert shed.checks == []


def test_with_the_queue_on_a_request_is_held_and_resumed():
    shed, tenancy = Refuse(), Tenancy()
    c, pool, index, clock = core(shedder=shed, tenancy=tenancy, queue=Queue())
    v = c.decide(ask(index), clock.t)
    assert isinstance(v, Hold) and v.ticket is tenancy.tickets[0]
    assert shed.checks == []  # the queue probes, not the core
    assert isinstance(v.probe(clock.t), Overloaded) and len(shed.checks) == 1
    # let in at once: routed as it was keyed; after a wait: keyed again, not re-admitted
    r = c.resume(v, False, clock.t)
    assert isinstance(r, Route) and r.ticket is tenancy.tickets[0]
    r2 = c.resume(v, True, clock.t)
    assert isinstance(r2, Route) and len(tenancy.tickets) == 1


def test_a_disaggregated_fleet_stops_at_admitted_and_a_leg_routes_among_its_own():
    c, pool, index, clock = core(disaggregated=lambda views: True)
    v = c.decide(ask(index), clock.t)
    assert isinstance(v, Admitted) and {x.id for x in v.views} == {"a", "b"}
    assert all(w.in_flight == 0 for w in pool)

    def to_b(kr, views, now):
        return Decision("b", Reason.LEAST_LOAD)

    leg = ask(index, choose=to_b, split=False)
    r = c.route(leg, v.views, v.keyed, None, clock.t)
    assert isinstance(r, Route) and r.worker.id == "b" and pool.get("b").in_flight == 1


def test_a_prefetch_is_chosen_unplaced_and_dropped_first_under_load():
    c, pool, index, clock = core(busy=lambda: False)
    v = c.decide(ask(index, prefetch=True, place=False), clock.t)
    assert isinstance(v, Route) and v.placement is None and all(w.in_flight == 0 for w in pool)
    placed = c.place(v.worker, v.keyed, clock.t)
    assert v.worker.in_flight == 1 and placed.own == PROMPT
    busy = core(busy=lambda: True)[0]
    r = busy.decide(ask(busy.parts.index, prefetch=True, place=False), clock.t)
    assert isinstance(r, Reject) and r.shed and "capacity" in r.error.message


def test_a_policy_naming_an_unknown_worker_is_a_bug():
    c, pool, index, clock = core()

    def void(kr, views, now):
        return Decision("nobody", Reason.MISS)

    with pytest.raises(AssertionError, match="unknown worker"):
        c.decide(ask(index, choose=void), clock.t)


class Stages:
    """A caller's ``Marks`` (radixfleet.server.tracing): the stages told, in order."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def mark(self, stage: str) -> None:
        self.told.append(stage)


def test_a_tracing_caller_is_told_each_stage_as_it_ends():
    shed = Refuse()
    c, pool, index, clock = core()
    marks = Stages()
    v = c.decide(ask(index), clock.t, marks)  # no shedder: the whole chain, then choose, place
    assert isinstance(v, Route) and marks.told == ["match", "admit", "choose", "place"]
    marks = Stages()  # a retry runs no admission chain
    assert isinstance(c.decide(ask(index).admit(None), clock.t, marks), Route)
    assert marks.told == ["match", "choose", "place"]
    c.use_shedder(shed)
    marks = Stages()  # refused by the shedder: its admission stage never ended
    assert isinstance(c.decide(ask(index), clock.t, marks), Reject)
    assert marks.told == ["match"]
    marks = Stages()  # unplaced (a prefetch, a P/D prefill leg): no place stage
    assert isinstance(c.decide(ask(index, place=False).admit(None), clock.t, marks), Route)
    assert marks.told == ["match", "choose"]
    # and without marks the verdicts are the same (nothing else reads them)
    assert isinstance(c.decide(ask(index).admit(None), clock.t), Route)


def test_a_traced_decision_held_then_resumed_is_two_route_spans_around_the_queue():
    """radixfleet.server.tracing on the core: each decision a radixfleet.route span (its verdict,
    the stages' times), the admission queue's wait between them."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from radixfleet.common.tracing import Tracing
    from radixfleet.keys import Endpoint
    from radixfleet.server.tracing import RequestTrace

    mem = InMemorySpanExporter()
    tracing = Tracing(service_name="t", exporter=mem)
    trace = tracing.start({}, "radixfleet.request")
    assert trace is not None
    rt = RequestTrace(trace, Endpoint.CHAT)
    c, pool, index, clock = core(shedder=Refuse(), tenancy=Tenancy(), queue=Queue())
    held = rt.decide(c, ask(index), clock.t)
    assert isinstance(held, Hold)
    rt.held(clock.t, shed=False)
    assert isinstance(rt.resume(c, held, True, clock.t), Route)
    rt.end()
    tracing.flush()
    spans = [(s.name, dict(s.attributes)) for s in mem.get_finished_spans()]
    names = [n for n, _ in spans]
    assert names == [
        "radixfleet.request",
        "radixfleet.route",
        "radixfleet.admission_queue",
        "radixfleet.route",
    ]
    first, queue, second = spans[1][1], spans[2][1], spans[3][1]
    assert first["radixfleet.verdict"] == "hold" and first["radixfleet.shed"] is True
    assert set(first) >= {"radixfleet.route.match_us"} and "radixfleet.route.choose_us" not in first
    assert queue == {"radixfleet.shed": False}
    assert second["radixfleet.verdict"] == "route" and second["radixfleet.worker"] in ("a", "b")
    assert second["radixfleet.tokens.prompt"] == PROMPT and second["radixfleet.tokens.uncached"] == PROMPT
    assert {"radixfleet.route.match_us", "radixfleet.route.choose_us", "radixfleet.route.place_us"} <= set(
        second
    )
