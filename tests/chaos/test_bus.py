"""Attacks on the NATS bus, against two router replicas in their own processes.

Two ``radixfleet router`` processes (RouterProcess, a YAML ``bus`` section, the
agent token in their environment) and two agents share a real nats-server on
loopback. A peer on the same host publishes raw messages with nats-py:

- router messages whose in-flight counts are 10**400 (and NaN ages), unsigned and
  signed with the agent token (a compromised replica): every request still gets an
  answer below 500, the counts never reach a policy, each drop is counted by cause;
- a JetStream snapshot with a ``register`` section for a worker ``busevil`` whose URL
  is the attacker's own server, unsigned and with a forged signature: neither replica
  adds it, no prompt reaches it;
- one replica's signed limits message, captured off the bus and published again 300
  times within ``bus.max_skew_s`` (each copy verifies): the other replica charges it
  once, and the tenant it names is not locked out there.

After each probe the routers' logs hold no traceback and their RSS and open
descriptors settle back near where they were.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixfleet.wire.bus_wire import BusKey, Subjects
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.router_process import RouterProcess
from tests.bus.client import tenant_load
from tests.nats_server import NatsServer

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("bus_salt")]

TOKEN = "chaos-agent-token-3c1"
ENV = {"RADIXFLEET_AGENT_TOKEN": TOKEN, "RADIXFLEET_TENANT_SALT": "chaos-salt"}
SYSTEM = "You are a terse assistant. " * 12
ROUTER_YAML = """
health: {{interval_s: 0.2, timeout_s: 1.0, failure_threshold: 2}}
keys: {{tenant: {{source: header}}}}
tenancy: {{tenants: {{acme: {{requests_per_s: 2, request_burst: 4}}}}}}
bus: {{url: "{url}", replica_id: {replica}, heartbeat_s: 0.2, replica_ttl_s: 1.0,
       backoff_s: 0.1, backoff_max_s: 0.5}}
"""


class Attacker:
    """The forged worker's HTTP server: counts every request that reaches it (health
    checks included) and the prompts among them (POSTs)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hits = 0
        self.prompts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                outer.hits += 1
                outer.prompts += self.command == "POST"
                body = b'{"status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent(i: int, bus_url: str) -> Proc:
    port = free_port()
    return Proc(
        radixfleet_argv(
            "agent", "--port", str(port), "--worker-id", f"ag{i}", "--bus", bus_url, "--kv-tokens", "400000"
        ),
        ready_url=f"http://127.0.0.1:{port}/health",
        timeout_s=30,
        env=ENV,
    )


def bad_messages(r: RouterProcess) -> dict[str, float]:
    text = httpx.get(f"{r.admin}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "radixfleet_bus_bad_messages":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["cause"]] = s.value
    return out


def worker_ids(r: RouterProcess) -> set[str]:
    body = httpx.get(f"{r.admin}/admin/workers", timeout=5).json()
    return {w["id"] for w in body["workers"]}


def healthy(r: RouterProcess) -> set[str]:
    body = httpx.get(f"{r.admin}/admin/workers", timeout=5).json()
    return {w["id"] for w in body["workers"] if w.get("health") == "healthy"}


def wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


async def users(routers: list[RouterProcess], n: int, tag: str, shared: bool = True) -> list[int]:
    """``n`` users' chat requests, spread over the replicas; their status codes.
    ``shared``: behind one system prompt (else each user's own: no cached prefix
    draws them to the workers already warm, so a new worker gets its share)."""
    async with httpx.AsyncClient(timeout=60) as c:

        async def one(i: int) -> int:
            r = routers[i % len(routers)]
            resp = await c.post(
                f"{r.base}/v1/chat/completions",
                json={
                    "model": "llama-3-8b",
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": SYSTEM if shared else f"{i} {tag} " * 40},
                        {"role": "user", "content": f"user {i} asks about {tag}"},
                    ],
                },
            )
            return resp.status_code

        return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.fixture
def fleet():
    """A nats-server, two agents on the bus, two router replicas (processes)."""
    with NatsServer(free_port()) as ns:
        agents = [agent(i, ns.url).__enter__() for i in range(2)]
        routers = []
        try:
            for name in ("r1", "r2"):
                routers.append(
                    RouterProcess(ROUTER_YAML.format(url=ns.url, replica=name), env=ENV).__enter__()
                )
            for r in routers:
                wait(lambda: {"ag0", "ag1"} <= healthy(r), 30, f"agents healthy on {r.base}")
            yield ns, routers
        finally:
            for r in routers:
                r.__exit__(None, None, None)
            for a in agents:
                a.__exit__(None, None, None)


async def publish_for(nc, subject: str, bodies: list[tuple[bytes, dict | None]], seconds: float) -> int:
    """Publishes ``bodies`` in turn every 20 ms for ``seconds``; how many were sent."""
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data, headers = bodies[sent % len(bodies)]
        await nc.publish(subject, data, headers=headers)
        sent += 1
        await asyncio.sleep(0.02)
    await nc.flush()
    return sent


async def test_overflowing_in_flight_counts_never_reach_a_policy(fleet):
    ns, routers = fleet
    assert all(s == 200 for s in await users(routers, 8, "warm-up"))
    base = [r.resources() for r in routers]
    subject = Subjects("radixfleet").router("evil")
    huge = [10**400, 10**400]
    bodies = []
    for extra in (
        {"inflight": {"ag0": huge, "ag1": huge}},
        {"inflight": {"ag0": [1, 2]}, "hints": [["ag0", float("nan"), [1]]]},
    ):
        data = json.dumps(
            {"v": 1, "kind": "router", "replica": "evil", "seq": 1, "block_bytes": 128, "full": True, **extra}
        ).encode()
        bodies.append((data, None))  # unsigned: a stranger on the bus
        bodies.append((data, BusKey(TOKEN).sign(subject, data)))  # a replica gone bad
    nc = await nats.connect(ns.url)
    try:
        probe = asyncio.ensure_future(publish_for(nc, subject, bodies, 4.0))
        codes: list[int] = []
        while not probe.done():
            codes += await users(routers, 20, f"probe {len(codes)}")
        sent = await probe
        codes += await users(routers, 20, "after")
    finally:
        await nc.close()
    assert sent >= 20
    assert codes and not [c for c in codes if c >= 500], sorted(set(codes))
    assert set(codes) == {200}
    for r, b in zip(routers, base):
        counts = bad_messages(r)
        assert counts.get("unsigned", 0) >= sent // 2 - 1, counts
        assert counts.get("bad_router", 0) + counts.get("not_json", 0) >= sent // 2 - 1, counts
        r.assert_settles(b, rss_slack=64 << 20, fd_slack=16)
        r.assert_no_tracebacks()
        out = r.output()
        # logged once per cause (at most once a minute), not once per message
        assert out.count("[unsigned]") == 1, out[-3000:]
        assert out.count("[bad_router]") <= 1 and out.count("[not_json]") <= 1, out[-3000:]


async def test_a_forged_registration_never_adds_a_worker_nor_gets_a_prompt(fleet):
    ns, routers = fleet
    base = [r.resources() for r in routers]
    with Attacker() as evil:
        subject = Subjects("radixfleet").agent("busevil")
        data = json.dumps(
            {
                "v": 1,
                "kind": "agent",
                "register": {"models": ["llama-3-8b"], "block_bytes": 128},
                "batch": {
                    "worker_id": "busevil",
                    "url": f"http://127.0.0.1:{evil.port}",
                    "epoch": "e1",
                    "seq": 0,
                    "events": [{"type": "snapshot", "blocks": []}],
                },
            }
        ).encode()
        nc = await nats.connect(ns.url)
        try:
            js = nc.jetstream()
            await js.publish(subject, data)  # unsigned
            await js.publish(subject, data, headers=BusKey("a guessed token").sign(subject, data))
            await js.publish(
                subject,
                data,
                headers={  # a signature made up
                    "Radixfleet-Signature": f"v1 {int(time.time() * 1000)} " + "ab" * 32
                },
            )
        finally:
            await nc.close()
        for r in routers:
            wait(
                lambda: (
                    bad_messages(r).get("unsigned", 0) >= 1 and bad_messages(r).get("bad_signature", 0) >= 2
                ),
                10,
                "drops counted",
            )
        time.sleep(1.0)  # a health-check period or five: long enough to have been added
        codes = await users(routers, 20, "secrets", shared=False)
        assert set(codes) == {200}, codes
        for r in routers:
            assert "busevil" not in worker_ids(r)
        assert (evil.prompts, evil.hits) == (0, 0)
    for r, b in zip(routers, base):
        r.assert_settles(b, rss_slack=64 << 20, fd_slack=16)
        r.assert_no_tracebacks()


async def test_a_replayed_limits_message_is_charged_once(fleet):
    """r1's signed limits message for tenant acme (2 requests/s, burst 4), replayed
    300 times: every copy verifies (it is the fleet's own signature, within
    max_skew_s), and before sequences r2 charged each, 600 requests of debt that
    locked acme out of r2 for 5 minutes. Now r2 charges it once and answers acme."""
    ns, (r1, r2) = fleet
    base = r2.resources()
    nc = await nats.connect(ns.url)
    captured: list[tuple[bytes, dict | None]] = []

    async def capture(msg) -> None:
        captured.append((msg.data, msg.headers))

    try:
        sub = await nc.subscribe(Subjects("radixfleet").limits("r1"), cb=capture)
        assert await tenant_load([r1.base], "acme", 10, 0.2) == [200, 200]
        wait_s = time.monotonic() + 5
        while not captured:
            assert time.monotonic() < wait_s, "r1 published no limits message"
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
        await asyncio.sleep(2.5)  # r2's copy of acme's bucket refills to its burst
        data, headers = captured[0]
        assert headers and "Radixfleet-Signature" in headers, headers
        for _ in range(300):
            await nc.publish(Subjects("radixfleet").limits("r1"), data, headers=headers)
        await nc.flush()
        await asyncio.sleep(1.0)  # delivered (loopback) and applied, or dropped
    finally:
        await nc.close()
    assert await tenant_load([r2.base], "acme", 10, 0.3) == [200, 200, 200]
    assert bad_messages(r2).get("replayed", 0) == 300
    assert bad_messages(r1).get("replayed", 0) == 0  # its own messages: ignored before
    r2.assert_settles(base, rss_slack=64 << 20, fd_slack=16)
    r2.assert_no_tracebacks()
    out = r2.output()
    assert out.count("[replayed]") == 1, out[-3000:]
