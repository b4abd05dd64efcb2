"""Who may register a worker and at which addresses (radixfleet/fleet/registration.py), how fast
one URL may take new epochs (radixfleet/fleet/pool.py EpochBudget), the bounds of a load report
within itself (radixfleet/wire/events.py) and where a vLLM's /kv_event_sources may point
(radixfleet/engines/event_sources.py). No servers: the guard's listeners are told, its
resolver is a table."""

from __future__ import annotations

import logging

import pytest

from radixfleet.config import parse_config
from radixfleet.engines.event_sources import EventSource, endpoint_problem, sources_problem
from radixfleet.fleet.pool import EpochBudget, Pool, Source
from radixfleet.fleet.registration import (
    AGENT_TOKEN_REQUIRED,
    WORKER_HOST_NOT_ALLOWED,
    RegistrationGuard,
    UrlIsRouter,
)
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.server.metrics import Metrics
from radixfleet.wire import events as ev
from radixfleet.wire.errors import Forbidden, MalformedRequest, Overloaded

NAMES = {
    "localhost": ["127.0.0.1", "::1"],
    "agent.internal": ["10.1.2.3"],
    "split.internal": ["10.1.2.3", "8.8.8.8"],
}


async def table(host: str, port: int) -> list[str]:
    if host not in NAMES:
        raise OSError(f"{host} does not resolve")
    return NAMES[host]


def guard(
    raw: dict | None = None, listeners=(("127.0.0.1", 8000),)
) -> tuple[RegistrationGuard, Metrics, Pool]:
    cfg = parse_config(raw or {})
    metrics = Metrics()
    pool = Pool(cfg, PrefixIndex())
    g = RegistrationGuard(pool, metrics, resolver=table)
    g.listening(listeners)
    return g, metrics, pool


def refused(metrics: Metrics, reason: str) -> float:
    return metrics.registrations_refused.labels(reason=reason)._value.get()


async def check(
    g: RegistrationGuard, url: str, raw: dict | None = None, *, tokenless: bool = False, local=None
):
    await g.check_url("w", url, parse_config(raw or {}).registration, tokenless=tokenless, local=local)


# ------------------------------------------------------------------ the router's own URL


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000", "http://localhost:8000", "http://127.0.0.1:8000/v1"],
)
async def test_a_url_at_the_routers_own_listener_is_400(url):
    g, metrics, _ = guard()
    with pytest.raises(UrlIsRouter) as e:
        await check(g, url)
    assert e.value.status == 400 and e.value.code == "worker_url_is_router" and e.value.param == "url"
    assert refused(metrics, "worker_url_is_router") == 1


@pytest.mark.parametrize("url", ["http://127.0.0.1:8001", "http://127.0.0.2:8000", "http://[::1]:8000"])
async def test_another_port_or_address_than_a_concrete_listener_is_not_the_router(url):
    g, _, _ = guard()
    await check(g, url)


async def test_a_wildcard_listener_is_every_address_of_this_host_at_its_port():
    g, _, _ = guard(listeners=(("0.0.0.0", 9000),))
    for url in ("http://127.0.0.1:9000", "http://127.0.0.2:9000", "http://localhost:9000"):
        with pytest.raises(UrlIsRouter):
            await check(g, url)
    await check(g, "http://[::1]:9000")  # an IPv4 wildcard takes no IPv6 address
    await check(g, "http://10.1.2.3:9000")  # not an address of this host
    g6, _, _ = guard(listeners=(("::", 9000, 0, 0),))
    for url in ("http://[::1]:9000", "http://127.0.0.1:9000"):  # dual stack
        with pytest.raises(UrlIsRouter):
            await check(g6, url)


async def test_the_listener_a_registration_arrived_on_counts_as_the_routers():
    """An embedded app (no RouterServer to say where it listens) learns its listener
    from the registration's own connection."""
    g, _, _ = guard(listeners=())
    with pytest.raises(UrlIsRouter):
        await check(g, "http://127.0.0.1:7000", local=("127.0.0.1", 7000))


# ------------------------------------------------------------------- without the token


def test_a_tokenless_agent_api_answers_loopback_peers_on_a_loopback_listener_only(caplog):
    g, metrics, _ = guard()
    g.check_peer(True, "127.0.0.1", ("127.0.0.1", 8000), "/internal/v1/register")
    g.check_peer(True, "::1", ("::1", 8000, 0, 0), "/internal/v1/register")
    g.check_peer(False, "192.0.2.9", ("0.0.0.0", 8000), "/internal/v1/register")  # the token decides
    caplog.set_level(logging.WARNING, "radixfleet.registration")
    for peer, local in (("192.0.2.9", ("192.0.2.2", 8000)), ("127.0.0.1", ("192.0.2.2", 8000)), (None, None)):
        with pytest.raises(Forbidden) as e:
            g.check_peer(True, peer, local, "/internal/v1/register")
        assert e.value.status == 403 and e.value.code == AGENT_TOKEN_REQUIRED
    assert refused(metrics, AGENT_TOKEN_REQUIRED) == 3
    # one line, the two refusals after it (within a second) counted into the next one
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "192.0.2.9" in lines[0] and "no agent token" in lines[0], lines


async def test_a_tokenless_router_registers_loopback_workers_only():
    g, metrics, _ = guard()
    await check(g, "http://127.0.0.1:9001", tokenless=True)
    await check(g, "http://localhost:9001", tokenless=True)
    for url in ("http://10.1.2.3:9001", "http://agent.internal:9001", "http://nowhere.invalid:9001"):
        with pytest.raises(Forbidden) as e:
            await check(g, url, tokenless=True)
        assert e.value.code == WORKER_HOST_NOT_ALLOWED and e.value.param == "url"
        await check(g, url)  # with the token: any host
    assert refused(metrics, WORKER_HOST_NOT_ALLOWED) == 3


# -------------------------------------------------------------------- registration.allow


async def test_the_allow_list_admits_only_hosts_every_address_of_which_is_inside_it():
    g, _, _ = guard()
    allow = {"registration": {"allow": ["10.0.0.0/8", "fd00::/8"]}}
    for url in ("http://10.1.2.3:1", "http://agent.internal:1", "http://[fd00::5]:1"):
        await check(g, url, allow)
    for url, why in (
        ("http://192.0.2.1:1", "192.0.2.1 is not inside registration.allow"),
        ("http://split.internal:1", "8.8.8.8 is not inside"),
        ("http://nowhere.invalid:1", "does not resolve"),
        ("http://127.0.0.1:9", "127.0.0.1 is not inside"),  # loopback is not implied
    ):
        with pytest.raises(Forbidden) as e:
            await check(g, url, allow)
        assert why in e.value.message, e.value.message


async def test_the_allow_list_may_admit_what_discovery_found():
    g, _, pool = guard()
    pool.add("found", "http://10.9.9.9:8000", Source.DISCOVERY)
    pool.add("listed", "http://10.9.9.8:8000", Source.CONFIG)
    allow = {"registration": {"allow": ["discovery"]}}
    await check(g, "http://10.9.9.9:8001", allow)  # the host, at any port
    with pytest.raises(Forbidden):
        await check(g, "http://10.9.9.8:8000", allow)  # a file worker is not discovered


def test_allow_entries_are_checked_with_the_config():
    with pytest.raises(Exception, match=r"registration.allow\[1\]: expected an IP address, a CIDR"):
        parse_config({"registration": {"allow": ["10.0.0.0/8", "10.0.0.0/33"]}})
    with pytest.raises(Exception, match="registration.allow: expected a list"):
        parse_config({"registration": {"allow": "10.0.0.0/8"}})


# ------------------------------------------------------------------ epochs per URL


def test_new_epochs_at_one_url_are_a_bucket_refilled_over_the_minute():
    b = EpochBudget()
    for _ in range(3):
        assert b.wait("u", 3, 0.0) == 0.0
        b.spend("u", 3, 0.0, keep=1)
    assert b.wait("u", 3, 0.0) == pytest.approx(20.0)  # one epoch each 20 s
    assert b.wait("u", 3, 10.0) == pytest.approx(10.0)
    assert b.wait("u", 3, 20.0) == 0.0
    assert b.wait("v", 3, 0.0) == 0.0  # another URL, its own budget


def test_the_epoch_budget_forgets_urls_whose_budget_is_full_again():
    b = EpochBudget()
    for i in range(100):
        b.spend(f"old{i}", 10, 0.0, keep=1)
    assert len(b) == 100  # each still owes a part of its minute
    for i in range(10):
        b.spend(f"new{i}", 10, 60.0, keep=1)  # a minute on: the old ones are full again
    assert len(b) <= 64 and b.wait("new9", 10, 60.0) == 0.0 and b.wait("old0", 10, 60.0) == 0.0


async def test_flapping_a_url_through_ids_roles_or_epochs_spends_one_budget():
    """Re-registering an address under another id (or role) makes a new pool entry
    each time; the budget is the URL's, so that is no way around it."""
    import aiohttp

    cfg = parse_config({"registration": {"epochs_per_min": 4}, "health": {"interval_s": 3600}})
    now = [0.0]
    pool = Pool(cfg, PrefixIndex(), clock=lambda: now[0])
    async with aiohttp.ClientSession() as session:
        await pool.start(session)
        try:
            url = "http://127.0.0.1:9"
            pool.register("a", url, "e0")  # a new URL: the new-worker rate, not this budget
            for wid, epoch, role in (
                ("b", "e0", "both"),
                ("b", "e1", "both"),
                ("b", "e1", "prefill"),
                ("c", "e1", "prefill"),
            ):
                pool.register(wid, url, epoch, role=role)
            with pytest.raises(Overloaded) as e:
                pool.register("d", url, "e1", role="prefill")
            assert e.value.code == "epoch_churn" and e.value.retry_after_s == pytest.approx(15.0)
            assert [w.id for w in pool] == ["c"]
            pool.register("c", url, "e1", role="prefill")  # the same process again: not an epoch
            now[0] = 15.0
            pool.register("d", url, "e2", role="prefill")
            pool.check()
        finally:
            await pool.aclose()


async def test_re_registering_the_same_process_spends_nothing():
    """An agent re-registers (after a 404) with its epoch; one saying role "both" at
    a configured prefill entry says nothing about the role: neither is a new epoch."""
    import aiohttp

    url = "http://127.0.0.1:9"
    cfg = parse_config(
        {
            "registration": {"epochs_per_min": 2},
            "health": {"interval_s": 3600},
            "workers": [
                {"url": url, "id": "p", "role": "prefill"},
                {"url": "http://127.0.0.1:8", "role": "decode"},
            ],
        }
    )
    pool = Pool(cfg, PrefixIndex())
    async with aiohttp.ClientSession() as session:
        await pool.start(session)
        try:
            for _ in range(10):
                pool.register("p", url, "e0")
            assert pool.get("p").role == "prefill" and pool.get("p").registered_epoch == "e0"
        finally:
            await pool.aclose()


# ---------------------------------------------------------------- load within itself


@pytest.mark.parametrize(
    "load, field",
    [
        ({"kv_used_tokens": 1001, "kv_capacity_tokens": 1000}, "'load.kv_used_tokens'"),
        ({"queued_tokens": 10, "queued_prefill_tokens": 11}, "'load.queued_prefill_tokens'"),
    ],
)
def test_a_load_report_beyond_the_workers_own_limits_is_refused_naming_the_field(load, field):
    with pytest.raises(MalformedRequest) as e:
        ev.parse_load(load)
    assert field in e.value.message and e.value.param == "load"


def test_a_load_report_within_its_limits_is_taken():
    ld = ev.parse_load({"kv_used_tokens": 1000, "kv_capacity_tokens": 1000, "queued_tokens": 5})
    assert (ld.kv_used_tokens, ld.queued_prefill_tokens) == (1000, 5)
    assert ev.parse_load({"kv_used_tokens": 7}).kv_used_tokens == 7  # no capacity said: no bound


# ------------------------------------------------------------ /kv_event_sources endpoints


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://*:5557", "tcp://[::]:5557", "tcp://10.0.0.5:5557", "tcp://[::ffff:10.0.0.5]:5557"],
)
def test_an_endpoint_on_the_workers_own_host_is_followed(endpoint):
    assert endpoint_problem(endpoint, "10.0.0.5") is None


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("ipc:///tmp/engine.sock", "is not tcp://"),
        ("inproc://x", "is not tcp://"),
        ("tcp://10.0.0.6:5557", "not on the worker's host 10.0.0.5"),
        ("tcp://0.0.0.0:5557", "not on the worker's host"),  # the router would bind every interface
        ("tcp://[::ffff:127.0.0.1]:22", "not on the worker's host"),
        ("tcp://10.0.0.5", "is not tcp://HOST:PORT"),
    ],
)
def test_an_endpoint_off_the_workers_host_is_refused(endpoint, why):
    problem = endpoint_problem(endpoint, "10.0.0.5")
    assert problem is not None and why in problem, problem


def test_an_endpoint_inside_the_allow_list_or_named_as_the_worker_is_followed():
    import ipaddress

    assert endpoint_problem("tcp://10.0.0.6:5557", "10.0.0.5", (ipaddress.ip_network("10.0.0.0/24"),)) is None
    assert endpoint_problem("tcp://Engine.Internal:5557", "engine.internal") is None
    sources = (EventSource(0, "tcp://*:1", "t", None), EventSource(1, "tcp://*:2", "t", "tcp://10.0.0.9:3"))
    p = sources_problem(sources, "10.0.0.5")
    assert p is not None and p.cause.value == "not_allowed" and p.detail.startswith("rank 1: ")
    assert sources_problem(sources[:1], "10.0.0.5") is None
