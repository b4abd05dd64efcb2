"""A request can never recurse through the router: the hop mark (radixfleet/server/hops.py) on
whatever it sends, refused (508) when it comes back, and the registration rule
(radixfleet/fleet/registration.py) under churn.

Unit tests of the mark; in-process routers on loopback for the loops registration
cannot see (a configured worker at the router's own address, two routers listing
each other, /v1/models asked of itself) and a bounded property test: under any
sequence of registrations (the router's own URL in several spellings, a real
worker, a dead one; new epochs) and client requests, the router serves exactly the
requests clients sent and the real worker sees no more than that."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet.server.hops import HOP_HEADER, MAX_HOPS, Hops
from radixfleet.wire.errors import LoopDetected, MalformedRequest
from radixfleet_tools.bench.proxy import upstream_app
from radixfleet_tools.harness.procs import free_port
from tests.router.serve import FAST_HEALTH, start_app

A, B = "a" * 16, "b" * 16

# ----------------------------------------------------------------------- the mark


def test_a_request_carrying_this_routers_mark_is_a_loop():
    h = Hops(A)
    h.check({})
    h.check({HOP_HEADER: B})
    for value in (A, f"{B}, {A}", f"{A},{B}"):
        with pytest.raises(LoopDetected) as e:
            h.check({HOP_HEADER: value})
        assert e.value.status == 508 and e.value.code == "loop_detected"


def test_a_chain_longer_than_max_hops_is_a_loop_and_a_value_not_marks_is_400():
    h = Hops(A)
    h.check({HOP_HEADER: ", ".join([B] * MAX_HOPS)})
    with pytest.raises(LoopDetected):
        h.check({HOP_HEADER: ", ".join([B] * (MAX_HOPS + 1))})
    for bad in ("x", "b" * 15, f"{B};{B}", "b" * 17, B + "," * 3000):
        with pytest.raises(MalformedRequest):
            h.check({HOP_HEADER: bad})


def test_what_a_router_forwards_carries_the_marks_it_arrived_with_then_its_own():
    h = Hops(A)
    assert h.lines({}) == f"{HOP_HEADER}: {A}\r\n".encode()
    assert h.lines({HOP_HEADER: f" {B} "}) == f"{HOP_HEADER}: {B}, {A}\r\n".encode()
    assert h.headers() == {HOP_HEADER: A}
    assert h.headers({HOP_HEADER: B}) == {HOP_HEADER: f"{B}, {A}"}
    assert Hops().mark != Hops().mark  # 64 random bits per router


# ------------------------------------------------------------- loops on loopback


async def _router(raw: dict, port: int | None = None) -> tuple[Router, RouterServer, str, list[int]]:
    """A router on loopback and the count of data-plane requests it received."""
    router = Router(parse_config({"health": FAST_HEALTH, **raw}))
    arrived = [0]
    serve = router.dataplane.serve

    async def counted(ex, endpoint):  # every data-plane arrival, looped ones too
        arrived[0] += 1
        await serve(ex, endpoint)

    router.dataplane.serve = counted  # before the server takes it
    server = RouterServer(router, port=port or free_port(), admin_port=0)
    p = await server.start()
    return router, server, f"http://127.0.0.1:{p}", arrived


def _count(metric, *labels: str) -> float:
    return metric.labels(*labels)._value.get()


async def _until(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.integration
async def test_a_configured_worker_at_the_routers_own_address_costs_one_hop():
    """Registration never sees a file worker: without the mark, one request here
    recursed until every admission slot was taken."""
    port = free_port()
    router, server, base, arrived = await _router(
        {"workers": [{"url": f"http://127.0.0.1:{port}", "id": "me"}]}, port
    )
    try:
        await _until(lambda: bool(router.pool.views(time.monotonic())))
        async with httpx.AsyncClient(timeout=10) as c:
            t0 = time.monotonic()
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 502, r.text
            assert time.monotonic() - t0 < 5
            m = await c.get(base + "/v1/models")
            assert m.status_code == 200 and m.json()["data"] == [], m.text
        assert arrived[0] == 2  # the client's request and its one hop back
        assert _count(router.metrics.rejected, "508", "loop_detected") >= 2  # that hop, /v1/models'
        assert router.admission.active == 0
    finally:
        await server.aclose()


@pytest.mark.integration
async def test_two_routers_listing_each_other_stop_at_the_first_return():
    pa, pb = free_port(), free_port()
    ra, sa, base_a, at_a = await _router({"workers": [{"url": f"http://127.0.0.1:{pb}", "id": "b"}]}, pa)
    rb, sb, _, at_b = await _router({"workers": [{"url": f"http://127.0.0.1:{pa}", "id": "a"}]}, pb)
    try:
        await _until(lambda: bool(ra.pool.views(time.monotonic())) and bool(rb.pool.views(time.monotonic())))
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(base_a + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 502, r.text
        # A -> B -> A, refused there (B's mark travelled with it): no second lap
        assert (at_a[0], at_b[0]) == (2, 1)
        assert ra.admission.active == rb.admission.active == 0
    finally:
        await sa.aclose()
        await sb.aclose()


# --------------------------------------------- property: registration churn


SELF = ("http://127.0.0.1:{p}", "http://localhost:{p}", "http://0x7f.1:{p}/", "http://[::ffff:127.0.0.1]:{p}")

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("register"),
            st.sampled_from([*SELF, "real", "dead"]),
            st.sampled_from(["w0", "w1", "loop"]),
            st.sampled_from(["e0", "e1", "e2"]),
            st.sampled_from([["m"], ["m2"], ["m", "m2"]]),
        ),
        st.tuples(st.just("request"), st.sampled_from(["m", "m2"])),
    ),
    min_size=1,
    max_size=10,
)


async def _scenario(steps) -> None:
    up, real = await start_app(upstream_app("real", model="m"))
    router, server, base, served = await _router({})
    port = int(base.rsplit(":", 1)[1])
    sent = 0
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            for step in steps:
                if step[0] == "register":
                    _, target, wid, epoch, models = step
                    url = real if target == "real" else "http://127.0.0.1:9" if target == "dead" else target
                    r = await c.post(
                        base + "/internal/v1/register",
                        json={"worker_id": wid, "url": url.format(p=port), "epoch": epoch, "models": models},
                    )
                    if target in SELF:
                        assert r.status_code == 400 and r.json()["status"] == "worker_url_is_router", r.text
                    await asyncio.sleep(0.15)  # a probe round: new entries turn routable
                else:
                    sent += 1
                    r = await c.post(
                        base + "/v1/completions", json={"model": step[1], "prompt": "x", "max_tokens": 1}
                    )
                    assert r.status_code < 600
            stats = (await c.get(real + "/stats")).json()
        assert served[0] == sent, (served[0], sent, steps)
        assert stats["requests"] <= sent, (stats, sent, steps)
        assert _count(router.metrics.rejected, "508", "loop_detected") == 0
        assert router.admission.active == 0
    finally:
        await server.aclose()
        await up.cleanup()


@pytest.mark.integration
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_under_registration_churn_the_router_serves_only_what_clients_sent(steps):
    asyncio.run(_scenario(steps))
