"""What a client may steer at the router's edge, against a live router process in
front of an agent (``radixfleet agent --schedule priority``, one request at a time)
that registers itself (announcing its priority order):

- the P/D legs: a client's ``kv_transfer_params`` (which an engine with a KV
  connector answers with its engine id, host and port) and SGLang's bootstrap and
  rank fields are refused with a 400 naming the field, so a colocated fleet's
  layout never reaches a client (``response_headers.worker_id`` is off);
- the engine queue: a sheddable tenant's ``/generate`` with ``priority: -1000``
  waits behind queued critical requests, its class (not its own value) in the
  engine's order.

Nothing is answered >= 500 and nothing is logged as a traceback.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.router_process import RouterProcess

pytestmark = pytest.mark.integration

ENV = {"RADIXFLEET_AGENT_TOKEN": "edge-token", "RADIXFLEET_TENANT_SALT": "edge-salt"}
CONFIG = (
    "listen: {host: 127.0.0.1, port: {port}}\n"
    "workers: []\n"
    "keys: {tenant: {source: header, header: x-tenant-id}}\n"
    "tenancy: {tenants: {vip: {priority: critical}, batch: {priority: sheddable}}}\n"
    "limits: {worker_queue_requests: 0}\n"  # never shed: the engine's queue is the probe
    "warmup: {enabled: false}\nreload: {watch: false}\n"
)


@pytest.fixture(scope="module")
def fleet():
    with RouterProcess(CONFIG, env=ENV) as r:
        port = free_port()
        argv = radixfleet_argv(
            "agent",
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--schedule",
            "priority",
            "--max-running",
            "1",
            "--max-waiting",
            "16",
            "--worker-id",
            "agent-7",
            "--router",
            r.base,
        )
        with Proc(argv, env=ENV, ready_url=f"http://127.0.0.1:{port}/health") as agent:
            deadline = time.monotonic() + 30
            while "agent-7" not in httpx.get(f"{r.base}/readiness", timeout=5).json().get("routable", []):
                assert time.monotonic() < deadline, r.output() + agent.output()
                time.sleep(0.05)
            yield r, port
        r.assert_no_tracebacks()


@pytest.mark.parametrize(
    "field,value",
    [
        ("kv_transfer_params", {"do_remote_decode": True}),
        ("bootstrap_host", "10.0.0.1"),
        ("bootstrap_port", 8998),
        ("bootstrap_room", 12345),
        ("data_parallel_rank", 1),
    ],
)
def test_a_client_cannot_steer_or_read_the_pd_legs(fleet, field, value):
    r, agent_port = fleet
    for path, body in (
        ("/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 2}),
        ("/generate", {"text": "hello there", "sampling_params": {"max_new_tokens": 2}}),
    ):
        resp = httpx.post(f"{r.base}{path}", json={**body, field: value}, timeout=30)
        assert resp.status_code == 400, resp.text[:300]
        err = resp.json()["error"]
        assert err["param"] == field and "router" in err["message"], err
        for secret in ("remote_", "agent-7", str(agent_port), "127.0.0.1"):
            assert secret not in resp.text, resp.text
        ok = httpx.post(f"{r.base}{path}", json={**body, field: None}, timeout=30)  # null: not set
        assert ok.status_code == 200, ok.text[:300]
        assert "kv_transfer_params" not in ok.text and str(agent_port) not in ok.text


def test_a_clients_priority_on_generate_does_not_jump_queued_critical_requests(fleet):
    # One request runs (the agent runs one at a time), four critical ones queue behind
    # it, then a sheddable tenant's /generate claims priority -1000: the agent's queue
    # orders by the value it gets, which must be the class's (sheddable, last).
    r, _ = fleet
    done: dict[str, float] = {}

    async def post(c: httpx.AsyncClient, name: str, path: str, body: dict, tenant: str) -> None:
        resp = await c.post(f"{r.base}{path}", json=body, headers={"x-tenant-id": tenant})
        assert resp.status_code == 200, resp.text[:300]
        done[name] = time.monotonic()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=16)) as c:
            long = {"model": "m", "prompt": "the running one", "max_tokens": 200}  # ~1.2 s
            tasks = [asyncio.create_task(post(c, "running", "/v1/completions", long, "vip"))]
            await asyncio.sleep(0.3)
            for i in range(4):
                short = {"model": "m", "prompt": f"critical request {i}", "max_tokens": 8}
                tasks.append(asyncio.create_task(post(c, f"critical-{i}", "/v1/completions", short, "vip")))
            await asyncio.sleep(0.2)
            claim = {"text": "a batch job", "sampling_params": {"max_new_tokens": 8}, "priority": -1000}
            tasks.append(asyncio.create_task(post(c, "sheddable", "/generate", claim, "batch")))
            await asyncio.gather(*tasks)

    asyncio.run(scenario())
    critical = [done[f"critical-{i}"] for i in range(4)]
    assert done["running"] < min(critical), done  # they queued behind it
    assert done["sheddable"] > max(critical), done  # and the claim did not jump them
