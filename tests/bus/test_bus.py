"""Several router replicas, one truth: the NATS JetStream bus
against a real nats-server on loopback (tests/nats_server.py installs it).

Two router replicas (in-process) and two ``radixfleet agent`` processes publishing
to the bus: both indexes equal; a third replica started late is ready within 2 s
with an entry count within 1% of its peers'; in-flight counts are shared; killing
the bus mid-run never fails a request (agents fall back to direct push, counts
to local); malformed and foreign messages are counted and ignored.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import nats
import pytest

from radixfleet.bus.remote_load import RemoteInFlight
from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet.wire.bus_wire import (
    BadMessage,
    RouterMessage,
    Subjects,
    parse_agent,
    parse_load,
    parse_router,
    worker_token,
)
from radixfleet.wire.errors import ConfigError, Overloaded
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from tests.bus.client import SYSTEM, bounded, chat, metric, tenant_load, wait_for
from tests.nats_server import NatsServer

pytestmark = pytest.mark.usefixtures("bus_salt")


def held(router: Router, wid: str) -> set[int]:
    """The block keys ``wid`` holds in ``router``'s index."""
    return {k for k, n in router.index._nodes.items() if n.held_by(wid)}


def bus_router(url: str, replica: str, extra: dict | None = None, **bus) -> Router:
    return Router(
        parse_config(
            {
                "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2},
                "policy": {"name": "prefix_load", "params": {"min_match_tokens": 32}},
                "bus": {
                    "url": url,
                    "replica_id": replica,
                    "heartbeat_s": 0.2,
                    "replica_ttl_s": 1.0,
                    "backoff_s": 0.1,
                    "backoff_max_s": 0.5,
                    **bus,
                },
                **(extra or {}),
            }
        )
    )


async def start(router: Router) -> tuple[RouterServer, str]:
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    return server, f"http://127.0.0.1:{port}"


def agent(i: int, bus_url: str, routers: list[str] = ()) -> Proc:
    ap = free_port()
    argv = [
        "agent",
        "--port",
        str(ap),
        "--worker-id",
        f"ag{i}",
        "--bus",
        bus_url,
        "--kv-tokens",
        "400000",
        "--bus-snapshot-interval",
        "5",
    ]
    for r in routers:
        argv += ["--router", r]
    return Proc(radixfleet_argv(*argv), ready_url=f"http://127.0.0.1:{ap}/health", timeout_s=30)


# ------------------------------------------------------------------ unit parts


def test_config_bus_section_validated_with_paths():
    assert not parse_config({}).bus.enabled()
    assert parse_config({"bus": {"url": "nats://10.0.0.1:4222"}}).bus.enabled()
    for raw, path in [
        ({"url": "http://x:1"}, "bus.url"),
        ({"stream": "a.b"}, "bus.stream"),
        ({"subject_prefix": "a b"}, "bus.subject_prefix"),
        ({"replica_id": "r.1"}, "bus.replica_id"),
        ({"heartbeat_s": 1.0, "replica_ttl_s": 0.5}, "bus.replica_ttl_s"),
        ({"storage": "disk"}, "bus.storage"),
        ({"flush": 1}, "bus.flush"),
        ({"max_bytes": 10}, "bus.max_bytes"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_config({"bus": raw})
        assert str(e.value).startswith(path), e.value


def test_a_bus_without_a_shared_salt_secret_is_refused(monkeypatch):
    """Replicas key prompts alike only with the deployment's secret: without
    $RADIXFLEET_TENANT_SALT or an agent token each process's random salt would hash
    the same prompt differently on every replica (and the agents cache it once per
    replica), so a router on a bus refuses to start, naming both ways out."""
    from radixfleet.config.reload import build

    cfg = parse_config({"bus": {"url": "nats://127.0.0.1:4222"}})
    monkeypatch.delenv("RADIXFLEET_TENANT_SALT")
    monkeypatch.delenv("RADIXFLEET_AGENT_TOKEN", raising=False)
    with pytest.raises(ConfigError) as e:
        build(cfg)
    assert str(e.value).startswith("bus.url"), e.value
    assert "RADIXFLEET_TENANT_SALT" in str(e.value) and "RADIXFLEET_AGENT_TOKEN" in str(e.value)
    build(parse_config({}))  # no bus: one process's own salt is its own business
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "a-token-shared-by-the-deployment-xyz")
    a, b = build(cfg), build(cfg)
    assert a.tenants.salts.shared and a.tenants.salts.salt("") == b.tenants.salts.salt("")
    monkeypatch.delenv("RADIXFLEET_AGENT_TOKEN")
    monkeypatch.setenv("RADIXFLEET_TENANT_SALT", "one-secret")
    assert build(cfg).tenants.salts.salt("acme") == build(cfg).tenants.salts.salt("acme")


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, flag",
    [
        (["--bus", "http://x:1"], "--bus"),
        (["--bus", "nats://x:99999"], "--bus"),
        (["--bus", "nats://x:1", "--bus-prefix", "a.b"], "--bus-prefix"),
    ],
)
def test_agent_refuses_a_bad_bus_flag_with_one_line_and_exit_2(args, flag):
    """The agent checks its bus flags by the same rules as the router's YAML
    (radixfleet.wire.bus_wire) before it listens."""
    import subprocess

    r = subprocess.run(
        radixfleet_argv("agent", "--port", str(free_port()), *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], r.stderr


def test_remote_in_flight_counts_replace_expire_and_bye():
    r = RemoteInFlight()
    m = lambda rep, seq, inf, full=False, bye=False: RouterMessage(  # noqa: E731
        rep, seq, 128, full, inf, [], bye
    )
    assert r.apply(m("a", 1, {"w1": (2, 100)}), 0.0) == {"w1"}
    assert r.apply(m("b", 1, {"w1": (1, 10), "w2": (1, 5)}), 0.0) == {"w1", "w2"}
    assert r.total("w1") == (3, 110)
    assert r.apply(m("a", 1, {"w1": (9, 9)}), 0.1) == set()  # repeated seq ignored
    assert r.apply(m("a", 2, {"w1": (0, 0)}), 0.2) == {"w1"}
    assert r.total("w1") == (1, 10)
    r.check()
    # a heartbeat (full) zeroes the workers it does not name
    assert r.apply(m("b", 2, {"w2": (1, 5)}, full=True), 0.5) == {"w1"}
    assert r.total("w1") == (0, 0) and r.total("w2") == (1, 5)
    assert r.expire(1.0, 0.6) == set()  # b heard at 0.5
    r.apply(m("a", 3, {"w3": (4, 4)}), 1.0)
    assert r.expire(1.2, 0.6) == {"w2"}  # b silent since 0.5
    assert r.apply(m("a", 4, {}, bye=True), 1.3) == {"w3"}
    assert r.totals == {} and r.replicas == {}
    r.check()


def test_peers_picks_count_in_shedding_as_in_scoring():
    """A burst split over replicas is the same burst: the tokens peers picked for a
    worker since its last report count in the shedding bound as this replica's own
    picks do (and in its view), so one replica sheds what one router would."""
    from radixfleet.fleet.pool import Pool, Source
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.route.shedding import Shedder
    from radixfleet.wire.events import Load

    pool = Pool(parse_config({}), PrefixIndex(), clock=lambda: 0.0)
    w = pool.add("w1", "http://127.0.0.1:1", Source.ADMIN)
    pool.register("w1", "http://127.0.0.1:1", "e1")
    pool.report_load(w, Load(queued_tokens=0, prefill_tokens_per_s=1000.0), 0.0)
    shed = Shedder(2.0, 0.5)
    assert shed.check([w], "", None, 100, 0.0) is None  # typical 0.1 s: bound 0.5 s
    pool.pick(w, 300)  # ours: 0.3 s queued
    assert shed.check([w], "", None, 100, 0.0) is None
    pool.set_remote(w, 2, 400)  # a peer's two picks: 0.7 s queued in all
    assert isinstance(shed.check([w], "", None, 100, 0.0), Overloaded)
    assert pool.views(0.0)[0].in_flight_tokens == 700  # what scoring sees, the same
    pool.set_remote(w, 1, 100)  # the peer's first token: released, never un-picked
    assert w.mark.since_tokens == 700
    pool.report_load(w, Load(queued_tokens=100, prefill_tokens_per_s=1000.0), 0.0)
    assert w.mark.since_tokens == 0 and shed.check([w], "", None, 100, 0.0) is None
    pool.check()


def test_wire_rejects_malformed_and_foreign_messages():
    s = Subjects("radixfleet")
    tok = worker_token("10.0.0.1:8000")
    assert s.agent("10.0.0.1:8000") == f"radixfleet.agent.{tok}" and "." not in tok
    cases = [
        (b"\xff\xfe", "not_json"),
        (b"[1,2]", "foreign"),
        (b'{"hello": 1}', "foreign"),
        (b'{"v": 1, "kind": "router"}', "wrong_kind"),
        (b'{"v": 1, "kind": "agent", "batch": {"seq": -1}}', "bad_batch"),
    ]
    for data, cause in cases:
        with pytest.raises(BadMessage) as e:
            parse_agent(data, tok)
        assert e.value.cause == cause
    ok = {
        "v": 1,
        "kind": "agent",
        "batch": {"worker_id": "w", "url": "http://h:1", "epoch": "e", "seq": 0, "events": []},
    }
    with pytest.raises(BadMessage) as e:
        parse_agent(json.dumps(ok).encode(), tok)  # worker w on another worker's subject
    assert e.value.cause == "wrong_subject"
    with pytest.raises(BadMessage) as e:
        parse_load(json.dumps({**ok, "kind": "load"}).encode(), worker_token("w"))
    assert e.value.cause == "bad_load"
    for bad in [
        {"replica": "", "seq": 1, "block_bytes": 128},
        {"replica": "r", "seq": 1, "block_bytes": 128, "inflight": {"w": [-1, 0]}},
        {"replica": "r", "seq": 1, "block_bytes": 128, "hints": [["w", 0, [1 << 64]]]},
    ]:
        with pytest.raises(BadMessage) as e:
            parse_router(json.dumps({"v": 1, "kind": "router", **bad}).encode())
        assert e.value.cause == "bad_router"
    msg = RouterMessage("r1", 3, 128, False, {"w": (1, 2)}, [("w", 0.5, [1, 2, 3])])
    back = parse_router(msg.to_bytes())
    assert (back.replica, back.seq, back.inflight, back.hints) == (
        "r1",
        3,
        {"w": (1, 2)},
        [("w", 0.5, [1, 2, 3])],
    )


# ---------------------------------------------------------- against nats-server


@pytest.mark.integration
@bounded()
async def test_replicas_share_one_truth_and_a_late_replica_warm_starts():
    with NatsServer(free_port()) as ns:
        a, b = bus_router(ns.url, "ra"), bus_router(ns.url, "rb")
        (sa, ua), (sb, ub) = await start(a), await start(b)
        agents = []
        c_server = None
        try:
            for i in range(2):
                agents.append(agent(i, ns.url).__enter__())
            for r in (a, b):
                await wait_for(
                    lambda r=r: len(r.pool.views(time.monotonic())) == 2,
                    15,
                    "both agents registered through the bus",
                )
            async with httpx.AsyncClient(timeout=30) as c:
                for i in range(80):  # round robin over the two replicas, 16 documents
                    r = await chat(
                        c,
                        (ua, ub)[i % 2],
                        f"question {i} " * (1 + i % 7),
                        system=f"Document {i % 16}: " + SYSTEM * 3,
                    )
                    assert r.status_code == 200, r.text

            # both indexes converge on the agents' truth
            def same() -> bool:
                return all(held(a, w) == held(b, w) for w in ("ag0", "ag1"))

            try:
                await wait_for(same, 5, "equal indexes")
            finally:
                print(
                    {
                        w: (
                            len(held(a, w)),
                            len(held(b, w)),
                            len(held(a, w) - held(b, w)),
                            len(held(b, w) - held(a, w)),
                        )
                        for w in ("ag0", "ag1")
                    }
                )
            assert a.index.stats().holder_entries > 100
            for w in ("ag0", "ag1"):
                assert a.index.entries(w) == b.index.entries(w)
            assert metric(a, "radixfleet_bus_messages_received_total", kind="agent") > 0
            assert metric(a, "radixfleet_bus_messages_received_total", kind="router") > 0
            # a third replica, started late: ready within 2 s, with its peers' entries
            c_router = bus_router(ns.url, "rc")
            t0 = time.monotonic()
            c_server, uc = await start(c_router)
            async with httpx.AsyncClient(timeout=5) as c:
                while True:
                    r = await c.get(uc + "/readiness")
                    if r.status_code == 200:
                        break
                    assert time.monotonic() - t0 < 2.0, r.json()
                    await asyncio.sleep(0.02)
            ready_s = time.monotonic() - t0
            body = r.json()
            assert body["bus"]["caught_up"], body
            peers = a.index.stats().holder_entries
            mine = c_router.index.stats().holder_entries
            assert abs(mine - peers) <= 0.01 * peers, (mine, peers, ready_s)
            print(f"late replica ready in {ready_s:.3f} s, entries {mine} vs peers {peers}")
            a.pool.check()
            b.pool.check()
            c_router.pool.check()
            a.index.check()
            c_router.index.check()
            a.bus.check()
            c_router.bus.check()
        finally:
            if c_server is not None:
                await c_server.aclose()
            for p in agents:
                p.__exit__(None, None, None)
            await sa.aclose()
            await sb.aclose()


@pytest.mark.integration
@bounded()
async def test_in_flight_counts_are_shared_between_replicas():
    with NatsServer(free_port()) as ns:
        a, b = bus_router(ns.url, "ra"), bus_router(ns.url, "rb")
        (sa, ua), (sb, _) = await start(a), await start(b)
        p = agent(0, ns.url).__enter__()
        try:
            for r in (a, b):
                await wait_for(
                    lambda r=r: len(r.pool.views(time.monotonic())) == 1, 15, "the agent registered"
                )
            async with httpx.AsyncClient(timeout=60) as c:
                # long answers held open on replica a: b must count them on ag0
                tasks = [asyncio.create_task(chat(c, ua, f"long {i}", max_tokens=400)) for i in range(3)]
                await wait_for(lambda: b.pool.get("ag0").remote_in_flight == 3, 5, "b sees a's 3 requests")
                view = next(v for v in b.pool.views(time.monotonic()) if v.id == "ag0")
                assert view.in_flight >= 3  # the policy's view includes them
                assert b.pool.get("ag0").in_flight == 0  # b's own count is its own
                for t in tasks:
                    assert (await t).status_code == 200
            await wait_for(
                lambda: b.pool.get("ag0").remote_in_flight == 0, 5, "finished requests released on b"
            )
            # a replica that leaves says bye: the others drop it at once, not after
            # replica_ttl_s (1 s here)
            assert "ra" in b.bus.remote.replicas
            await sa.aclose()
            t0 = time.monotonic()
            await wait_for(lambda: "ra" not in b.bus.remote.replicas, 0.5, "bye")
            assert time.monotonic() - t0 < 0.5
            b.pool.check()
            b.bus.check()
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()
            await sb.aclose()


@pytest.mark.integration
@bounded()
async def test_bus_outage_degrades_to_direct_push_and_local_counts():
    with NatsServer(free_port()) as ns:
        a, b = bus_router(ns.url, "ra"), bus_router(ns.url, "rb")
        (sa, ua), (sb, ub) = await start(a), await start(b)
        p = agent(0, ns.url, [ua, ub]).__enter__()
        try:
            for r in (a, b):
                await wait_for(
                    lambda r=r: len(r.pool.views(time.monotonic())) == 1, 15, "the agent registered"
                )
            await wait_for(lambda: "rb" in a.bus.remote.replicas, 5, "a hears b")
            agent_info = p.ready_url.replace("/health", "/get_server_info")
            async with httpx.AsyncClient(timeout=5) as c:
                info = (await c.get(agent_info)).json()
            assert info["bus"]["state"] == "up" and info["bus"]["snapshots"] >= 1, info
            # (before the bus was up, the agent pushed directly: the same fallback)
            http_before = [r["sent_batches"] for r in info["routers"]]
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(timeout=5) as c:
                info = (await c.get(agent_info)).json()
            assert [r["sent_batches"] for r in info["routers"]] == http_before  # bus only now
            async with httpx.AsyncClient(timeout=30) as c:
                ok = 0
                t_end = time.monotonic() + 4.0
                killed = False
                i = 0
                while time.monotonic() < t_end and i < 400:
                    if not killed and i == 10:
                        ns.kill()  # mid-run
                        killed = True
                    r = await chat(c, (ua, ub)[i % 2], f"outage {i % 5}")
                    assert r.status_code == 200, r.text
                    ok += 1
                    i += 1
                    await asyncio.sleep(0.01)
            assert killed and ok > 10
            for r in (a, b):
                assert metric(r, "radixfleet_bus_up") == 0
                assert (
                    metric(r, "radixfleet_bus_outages_total", cause="lost")
                    + metric(r, "radixfleet_bus_outages_total", cause="connect")
                    >= 1
                )
            # the others' counts expired; the agent pushes directly now
            assert a.bus.remote.replicas == {}
            async with httpx.AsyncClient(timeout=5) as c:
                deadline = time.monotonic() + 5
                while True:
                    info = (await c.get(agent_info)).json()
                    if all(r["sent_batches"] > n for r, n in zip(info["routers"], http_before)):
                        break
                    assert time.monotonic() < deadline, info
                    await asyncio.sleep(0.05)
            assert info["bus"]["state"] in ("down", "connecting"), info
            assert a.pool.get("ag0").remote_in_flight == 0
            # the bus comes back: the replicas reconnect and catch up again
            ns.start()
            for r in (a, b):
                await wait_for(lambda r=r: r.bus.conn.up, 10, "bus reconnected")
            async with httpx.AsyncClient(timeout=30) as c:
                r = await chat(c, ua, "after the outage")
                assert r.status_code == 200
            await wait_for(lambda: "rb" in a.bus.remote.replicas, 5, "a hears b again")
            a.pool.check()
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()
            await sb.aclose()


@pytest.mark.integration
@bounded()
async def test_malformed_and_foreign_bus_messages_are_counted_and_ignored():
    with NatsServer(free_port()) as ns:
        a = bus_router(ns.url, "ra")
        sa, ua = await start(a)
        nc = await nats.connect(ns.url)
        try:
            await wait_for(lambda: a.bus.conn.up, 10, "bus up")
            js = nc.jetstream()
            tok = worker_token("ghost:1")
            await js.publish(f"radixfleet.agent.{tok}", b"not json at all")
            await js.publish(f"radixfleet.agent.{tok}", b'{"some": "other app"}')
            await js.publish(
                f"radixfleet.agent.{tok}",
                json.dumps(
                    {
                        "v": 1,
                        "kind": "agent",
                        "batch": {"worker_id": "other:1", "url": "http://x:1", "epoch": "e", "seq": 0},
                    }
                ).encode(),
            )
            await nc.publish("radixfleet.router.evil", b'{"v": 1, "kind": "router", "seq": "x"}')
            await nc.publish("radixfleet.load.00", b"\x00\x01")
            await nc.publish(
                "radixfleet.router.old",
                RouterMessage("old", 1, 64, False, {}, [("ag9", 0.0, [1, 2])]).to_bytes(),
            )
            await nc.flush()
            want = {"not_json": 2, "foreign": 1, "wrong_subject": 1, "bad_router": 1, "config_mismatch": 1}

            def counted() -> bool:
                return all(
                    metric(a, "radixfleet_bus_bad_messages_total", cause=k) >= v for k, v in want.items()
                )

            await wait_for(counted, 5, "bad messages counted")
            assert a.bus.conn.up
            async with httpx.AsyncClient(timeout=5) as c:
                assert (await c.get(ua + "/readiness")).json()["bus"]["state"] == "up"
        finally:
            await nc.close()
            await sa.aclose()


@pytest.mark.integration
@bounded()
async def test_unreachable_bus_at_start_degrades_to_direct_push():
    dead = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    a = bus_router(dead, "ra")
    sa, ua = await start(a)
    p = agent(0, dead, [ua]).__enter__()
    try:
        # the agent falls back to --router; the replica reports ready without history
        await wait_for(lambda: len(a.pool.views(time.monotonic())) == 1, 15, "direct push")
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(ua + "/readiness")
            assert r.status_code == 200, r.text
            assert r.json()["bus"]["state"] == "down" and not r.json()["bus"]["caught_up"]
            r = await chat(c, ua, "no bus here")
            assert r.status_code == 200, r.text
        assert metric(a, "radixfleet_bus_up") == 0
        assert metric(a, "radixfleet_bus_outages_total", cause="connect") >= 1
        await wait_for(lambda: "ag0" in a.index.workers(), 5, "events pushed directly")
    finally:
        p.__exit__(None, None, None)
        await sa.aclose()


@pytest.mark.integration
@bounded()
async def test_a_sequence_gap_makes_the_agent_snapshot_again():
    with NatsServer(free_port()) as ns:
        a = bus_router(ns.url, "ra")
        sa, ua = await start(a)
        p = agent(0, ns.url).__enter__()
        nc = await nats.connect(ns.url)
        try:
            await wait_for(
                lambda: a.pool.get("ag0") is not None and a.pool.get("ag0").epoch is not None,
                15,
                "registered",
            )
            info_url = p.ready_url.replace("/health", "/get_server_info")
            async with httpx.AsyncClient(timeout=5) as c:
                snaps = (await c.get(info_url)).json()["bus"]["snapshots"]
                w = a.pool.get("ag0")
                # a batch from the future: the replica sees a gap and asks for a snapshot
                await nc.jetstream().publish(
                    Subjects("radixfleet").agent("ag0"),
                    json.dumps(
                        {
                            "v": 1,
                            "kind": "agent",
                            "batch": {
                                "worker_id": "ag0",
                                "url": w.url,
                                "epoch": w.epoch,
                                "seq": w.next_seq + 1000,
                                "events": [],
                            },
                        }
                    ).encode(),
                )
                deadline = time.monotonic() + 5
                while (await c.get(info_url)).json()["bus"]["snapshots"] <= snaps:
                    assert time.monotonic() < deadline, "no snapshot after the gap"
                    await asyncio.sleep(0.05)
            assert metric(a, "radixfleet_bus_messages_published_total", kind="snapshot_request") >= 1
            await wait_for(lambda: a.pool.get("ag0").next_seq < 1000, 5, "back in sync")
        finally:
            await nc.close()
            p.__exit__(None, None, None)
            await sa.aclose()


async def test_a_peers_hint_reaches_the_index_the_counts_and_the_write_rates():
    """What a peer picked is applied as if this replica had picked it: the hint in the
    index, the in-flight tokens in the views and the shedding evidence, and the KV it
    writes (the blocks the worker did not hold) in prefix_load's write rates, which
    judge KV turnover and break ties."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from radixfleet.bus.replica import BusReplica
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.policies.prefix_load import PrefixLoad

    now = 100.0
    index, pol = PrefixIndex(), PrefixLoad()
    cfg = parse_config({"bus": {"url": "nats://127.0.0.1:1", "replica_id": "me"}})
    pool = Pool(cfg, index, clock=lambda: now)
    for i in (1, 2):
        pool.register(f"w{i}", f"http://127.0.0.1:{i}", "e")
    rep = BusReplica(
        cfg.bus,
        pool=pool,
        index=index,
        feedback=None,
        block_bytes=128,
        registry=CollectorRegistry(),
        clock=lambda: now,
        policy=lambda: pol,
    )
    hashes = list(range(1, 11))
    index.insert("w1", hashes[:4], now - 5)  # w1 holds 4 of the 10 blocks
    msg = RouterMessage("peer", 1, 128, False, {"w1": (1, 200)}, [("w1", 0.0, hashes)])
    await rep._on_router(SimpleNamespace(data=msg.to_bytes(), subject="radixfleet.router.peer", headers=None))
    assert index.match(hashes, now, count=False).blocks == {"w1": 10}
    assert pool.get("w1").remote_tokens == 200 and pool.get("w1").mark.since_tokens == 200
    assert pol._write_rate("w1", now) == pytest.approx(6 * 32 / pol.params.kv_window_s)
    assert pol._write_rate("w2", now) == 0.0
    rep.check()
    pool.check()
    index.check()


async def test_a_peers_picks_reach_the_session_footprints_as_one_routers_would():
    """A session whose every turn a peer routed counts in this replica's prefix_load
    footprints as in one router's that routed them all: its branch continued turn by
    turn (live from its second turn, homed where the last turn went, sized by its
    prompt), so "crowded" is judged on the fleet's sessions, not on the share of
    turns this replica happened to route."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from radixfleet.bus.replica import BusReplica
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.policies.base import RouteRequest
    from radixfleet.policies.prefix_load import PrefixLoad

    now = 100.0
    cfg = parse_config({"bus": {"url": "nats://127.0.0.1:1", "replica_id": "me"}})
    index, pol = PrefixIndex(), PrefixLoad()
    pool = Pool(cfg, index, clock=lambda: now)
    one_index, one = PrefixIndex(), PrefixLoad()  # one router routing every turn
    one_pool = Pool(cfg, one_index, clock=lambda: now)
    for i in (1, 2):
        pool.register(f"w{i}", f"http://127.0.0.1:{i}", "e")
        one_pool.register(f"w{i}", f"http://127.0.0.1:{i}", "e")
    rep = BusReplica(
        cfg.bus,
        pool=pool,
        index=index,
        feedback=None,
        block_bytes=128,
        registry=CollectorRegistry(),
        clock=lambda: now,
        policy=lambda: pol,
    )
    turns = [
        (6.0, "w1", list(range(1, 11))),
        (4.0, "w1", list(range(1, 21))),
        (2.0, "w2", list(range(1, 31))),
    ]  # the third turn moved to w2
    for seq, (age, wid, hashes) in enumerate(turns, 1):
        msg = RouterMessage("peer", seq, 128, False, {}, [(wid, age, hashes)])
        await rep._on_router(
            SimpleNamespace(data=msg.to_bytes(), subject="radixfleet.router.peer", headers=None)
        )
        t = now - age
        req = RouteRequest(hashes, len(hashes) * 32, 32)
        one_match = one_index.match(hashes, t)
        branch = one.footprints.find(req)
        one.footprints.record(req, one_match, branch, wid, t)
        one_index.insert(wid, hashes, t)
        got = {w: pol.footprints.tokens(w) for w in ("w1", "w2")}
        assert got == {w: one.footprints.tokens(w) for w in ("w1", "w2")}, (seq, got)
    assert pol.footprints.tokens("w2") == 30 * 32 and pol.footprints.tokens("w1") == 0
    assert pol._write_rate("w2", now) > 0
    pol.check()
    rep.check()


def test_caught_up_waits_for_the_stream_and_one_heartbeat_of_the_peers():
    """A replica is caught up once it applied the stream's last message *and* one
    heartbeat_s passed since it subscribed (its peers' full counts heard); until then
    /readiness' bus body says so, with the lag."""
    from prometheus_client import CollectorRegistry

    from radixfleet.bus.replica import BusReplica
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex

    clock = [10.0]
    cfg = parse_config({"bus": {"url": "nats://127.0.0.1:1", "heartbeat_s": 0.5}})
    index = PrefixIndex()
    rep = BusReplica(
        cfg.bus,
        pool=Pool(cfg, index),
        index=index,
        feedback=None,
        block_bytes=128,
        registry=CollectorRegistry(),
        clock=lambda: clock[0],
    )
    rep._started = rep._subscribed = 10.0
    rep.target_seq, rep.applied_seq = 40, 30
    assert rep.describe()["caught_up"] is False and rep.describe()["lag"] == 10
    assert not rep.ready()
    rep.applied_seq = 40
    rep._mark_caught_up()
    assert rep.describe()["lag"] == 0 and not rep.ready()  # the peers not heard yet
    clock[0] = 10.5
    assert rep.ready() and rep.describe()["caught_up"] and rep.caught_up_s == 0.5


def test_replication_decisions_travel_and_apply_as_one_router_would():
    from radixfleet.policies.replication import HotRoots

    seen = []
    mine, theirs = HotRoots(8, max_replicas=2), HotRoots(8, max_replicas=2)
    mine.listener = lambda *a: seen.append(a)
    rec = mine.see(77, 3, 5.0, 0.0)
    mine.add_replica(rec, "w1", 0.0)
    mine.retire_newest(rec, {"w1"}, 1.0)
    assert seen == [("add", 77, 3, "w1"), ("retire", 77, 3, "w1")]
    msg = parse_router(RouterMessage("r", 1, 128, False, {}, [], repl=seen).to_bytes())
    for op, key, depth, w in msg.repl:
        theirs.apply_remote(op, key, depth, w, 2.0)
    r = theirs.get(77)
    assert r is not None and r.replicas == {} and "w1" in r.retired
    theirs.apply_remote("add", 77, 3, "w2", 3.0)
    assert list(theirs.get(77).replicas) == ["w2"]
    theirs.check()
    with pytest.raises(BadMessage):
        parse_router(
            json.dumps(
                {
                    "v": 1,
                    "kind": "router",
                    "replica": "r",
                    "seq": 1,
                    "block_bytes": 128,
                    "repl": [["copy", 1, 1, "w"]],
                }
            ).encode()
        )


@pytest.mark.integration
@bounded()
async def test_a_tenants_limit_holds_for_the_fleet_on_a_bus():
    """A tenant limited to R = 10 requests/s (burst 10) sends 2R for 5 s, alternating
    between two replicas: each replica alone sees exactly R and, with limits per
    replica, admits all 100. Sharing consumption over the bus (every 0.2 s) the
    fleet admits the limit: R x 5 s plus at most each replica's burst once (what
    the replicas admit before they hear of each other's), so within [45, 70]."""
    rate, seconds = 10, 5.0
    tenancy = {
        "keys": {"tenant": {"source": "header"}},
        "tenancy": {"tenants": {"acme": {"requests_per_s": rate, "request_burst": rate}}},
    }
    with NatsServer(free_port()) as ns:
        a, b = bus_router(ns.url, "ra", tenancy), bus_router(ns.url, "rb", tenancy)
        (sa, ua), (sb, ub) = await start(a), await start(b)
        p = agent(0, ns.url).__enter__()
        try:
            for r, peer in ((a, "rb"), (b, "ra")):
                await wait_for(
                    lambda r=r, peer=peer: (
                        len(r.pool.views(time.monotonic())) == 1 and peer in r.bus.remote.replicas
                    ),
                    15,
                    "the agent registered and the peer heard",
                )
            n = int(2 * rate * seconds)
            statuses = await tenant_load([ua, ub], "acme", 2 * rate, seconds)
            ok = statuses.count(200)
            print(f"admitted {ok} of {n} at {2 * rate} req/s for a {rate} req/s limit")
            assert statuses.count(429) == n - ok, sorted(set(statuses))
            assert 0.9 * rate * seconds <= ok <= rate * seconds + 2 * rate, ok
            assert metric(a, "radixfleet_bus_messages_received_total", kind="limits") > 0
            assert metric(b, "radixfleet_bus_messages_published_total", kind="limits") > 0
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()
            await sb.aclose()


@pytest.mark.integration
@bounded()
async def test_a_sessions_turns_on_two_replicas_are_one_session_in_both():
    """A client's session (x-session-id) whose turns alternate between two replicas
    is one branch in both replicas' footprints, keyed by the session's salted
    digest (the id itself never travels), homed where its last turn went."""
    with NatsServer(free_port()) as ns:
        a, b = bus_router(ns.url, "ra"), bus_router(ns.url, "rb")
        (sa, ua), (sb, ub) = await start(a), await start(b)
        p = agent(0, ns.url).__enter__()
        try:
            for r, peer in ((a, "rb"), (b, "ra")):
                await wait_for(
                    lambda r=r, peer=peer: (
                        len(r.pool.views(time.monotonic())) == 1 and peer in r.bus.remote.replicas
                    ),
                    15,
                    "the agent registered and the peer heard",
                )
            async with httpx.AsyncClient(timeout=30) as c:
                for i in range(4):  # every turn a fresh window: only the id ties them
                    r = await c.post(
                        (ua, ub)[i % 2] + "/v1/completions",
                        json={
                            "model": "llama-3-8b",
                            "prompt": f"turn {i} " + SYSTEM * (2 + i),
                            "max_tokens": 1,
                        },
                        headers={"x-session-id": "alice@example.com"},
                    )
                    assert r.status_code == 200, r.text
            key = a.salts.session_key("alice@example.com")
            assert key == b.salts.session_key("alice@example.com")
            fa, fb = a.policy.footprints, b.policy.footprints
            # b routed the last turn; a heard of it: the same branch, at its last turn
            await wait_for(
                lambda: (
                    key in fa._branches
                    and key in fb._branches
                    and fa._branches[key].tip == fb._branches[key].tip
                ),
                5,
                "the last turn heard",
            )
            for fp in (fa, fb):
                br = fp._branches[key]
                assert br.live and br.home == "ag0" and br.size == fb._branches[key].size
                assert not any(isinstance(k, str) and "alice" in k for k in fp._branches)
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()
            await sb.aclose()
