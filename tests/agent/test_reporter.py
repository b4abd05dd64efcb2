"""The reporter against a fake router: register, snapshot, deltas, 409/404, outages."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer

from radixfleet.keys import Endpoint, request_key
from radixfleet.wire.events import Cleared, Snapshot, Stored
from radixfleet_tools.agent.reporter import LinkState
from radixfleet_tools.agent.server import AGENT_KEY, REPORTER_KEY, AgentConfig, create_app
from radixfleet_tools.harness.procs import free_port
from tests.agent.fakes import FakeRouter

pytestmark = pytest.mark.integration


async def until(pred, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def setup(monkeypatch):
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "s3cret")
    port = free_port()
    fake = FakeRouter()
    await fake.start(port)
    app = create_app(
        AgentConfig(kv_tokens=4_000, worker_id="w0"),
        routers=[f"http://127.0.0.1:{port}"],
        advertise_url="http://127.0.0.1:1",
    )
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    client = ClientSession(base_url=str(srv.make_url("")), timeout=ClientTimeout(total=10))
    yield fake, app, client, port
    await client.close()
    await srv.close()
    await fake.stop()


def body(text, n=2):
    return {"model": "llama-3-8b", "prompt": text, "max_tokens": n}


async def test_register_snapshot_then_exact_deltas(setup):
    fake, app, client, _ = setup
    agent = app[AGENT_KEY]
    await until(lambda: fake.batches)
    reg = fake.registrations[0]
    assert reg["worker_id"] == "w0" and reg["url"] == "http://127.0.0.1:1" and reg["models"] == ["llama-3-8b"]
    first = fake.batches[0]
    assert first.seq == 0 and isinstance(first.events[0], Snapshot) and first.load.kv_capacity_tokens == 4_000
    assert set(fake.auth) == {"Bearer s3cret"}
    text = "a system prompt that is long enough for several blocks. " * 4
    await client.post("/v1/completions", json=body(text))
    key = request_key(Endpoint.COMPLETIONS, body(text))
    await until(lambda: set(key.hashes) <= set(fake.held.get("w0", {})))
    stored = [e for b in fake.batches for e in b.events if isinstance(e, Stored)]
    assert stored[0].parent is None and stored[0].hashes[: len(key.hashes)] == key.hashes
    # the router's model equals the agent's tree, block for block
    await until(lambda: fake.held["w0"] == dict(agent.cache.snapshot_blocks()))
    seqs = [b.seq for b in fake.batches]
    assert seqs == list(range(len(seqs)))


async def test_409_and_404_trigger_snapshot_and_reregistration(setup):
    fake, app, client, _ = setup
    agent = app[AGENT_KEY]
    await until(lambda: fake.batches)
    fake.answers = [409]
    await client.post("/v1/completions", json=body("first prompt " * 20))
    await until(lambda: not fake.answers and len(fake.batches) >= 3)
    n409 = fake.refused[0]
    after = fake.batches[n409 + 1]
    assert isinstance(after.events[0], Snapshot) and after.seq == fake.batches[n409].seq + 1
    await until(lambda: fake.held["w0"] == dict(agent.cache.snapshot_blocks()))
    regs = len(fake.registrations)
    fake.answers = [404]
    await client.post("/v1/completions", json=body("second prompt " * 20))
    await until(lambda: len(fake.registrations) == regs + 1 and len(fake.refused) == 2)
    await until(lambda: len(fake.batches) > fake.refused[1] + 1)
    assert isinstance(fake.batches[fake.refused[1] + 1].events[0], Snapshot)
    await until(lambda: fake.held["w0"] == dict(agent.cache.snapshot_blocks()))


async def test_unreachable_router_bounded_memory_then_snapshot(setup):
    fake, app, client, port = setup
    agent = app[AGENT_KEY]
    reporter = app[REPORTER_KEY]
    await until(lambda: fake.batches)
    await fake.stop()
    link = reporter.links[0]
    # a pool of 4,000 tokens churns: every request evicts older ones
    for i in range(30):
        await client.post("/v1/completions", json=body(f"prompt {i} " * 60, n=1))
        assert len(link.pending) <= reporter.max_pending_events
    await until(lambda: link.state is not LinkState.STREAMING and link.failures > 0)
    assert link.pending == []
    n = len(fake.batches)
    fake2 = FakeRouter()
    await fake2.start(port)
    try:
        await until(lambda: fake2.batches)
        assert isinstance(fake2.batches[0].events[0], Snapshot)
        await until(lambda: fake2.held["w0"] == dict(agent.cache.snapshot_blocks()))
        assert agent.cache.stats.evicted_tokens > 0 and len(fake.batches) == n
    finally:
        await fake2.stop()


async def test_every_router_replica_gets_the_same_truth():
    p1, p2 = free_port(), free_port()
    f1, f2 = FakeRouter(), FakeRouter()
    await f1.start(p1)
    await f2.start(p2)
    app = create_app(
        AgentConfig(kv_tokens=3_000, worker_id="w9"),
        routers=[f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"],
        advertise_url="http://127.0.0.1:2",
    )
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        async with ClientSession(base_url=str(srv.make_url(""))) as c:
            for i in range(25):  # enough to churn a 3,000-token pool
                await c.post("/v1/completions", json=body(f"replica prompt {i} " * 30, n=3))
            agent = app[AGENT_KEY]
            truth = dict(agent.cache.snapshot_blocks())
            await until(lambda: f1.held.get("w9") == truth and f2.held.get("w9") == truth)
            assert agent.cache.stats.evicted_tokens > 0 and truth
    finally:
        await srv.close()
        await f1.stop()
        await f2.stop()


async def _settle(fake, reporter) -> int:
    """Batches so far, once the link streams and waits out a 30 s interval."""
    await until(lambda: fake.batches)
    await asyncio.sleep(0.15)  # let the link settle into its interval wait
    reporter.interval_s = 30.0  # from the next wait on, the interval never triggers a send
    await asyncio.sleep(0.15)
    return len(fake.batches)


async def test_a_full_batch_goes_out_before_the_interval(setup):
    fake, app, client, _ = setup
    reporter = app[REPORTER_KEY]
    n = await _settle(fake, reporter)
    reporter.max_batch_events = 1
    # a long answer: the prompt's Stored (at prefill) fills the batch before the answer ends
    long = body("trigger a stored event " * 10, n=400)
    answer = asyncio.create_task(client.post("/v1/completions", json=long))
    try:
        await until(lambda: len(fake.batches) > n, timeout=1.0)
        assert not answer.done()
        assert any(isinstance(e, Stored) for b in fake.batches[n:] for e in b.events)
    finally:
        await answer


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_ends_after_the_router_has_its_events(setup, stream):
    """A conversation's next turn, sent the moment the answer is in, is picked against
    an index that holds the prompt and the answer (Reporter.flush)."""
    fake, app, client, _ = setup
    agent = app[AGENT_KEY]
    n = await _settle(fake, app[REPORTER_KEY])
    text = "a prompt of whole blocks " * 16  # 400 bytes: a multiple of 4
    async with client.post("/v1/completions", json={**body(text, n=64), "stream": stream}) as r:
        assert r.status == 200
        await r.read()
        held = dict(fake.held["w0"])  # what the router holds as the answer ends
    assert len(fake.batches) > n
    truth = dict(agent.cache.snapshot_blocks())
    assert held == truth
    key = request_key(Endpoint.COMPLETIONS, body(text))
    assert len(truth) > len(key.hashes)  # the answer's blocks too, not only the prompt's


async def test_removed_blocks_go_out_within_a_poll(setup):
    fake, app, client, _ = setup
    await _settle(fake, app[REPORTER_KEY])
    await client.post("/v1/completions", json=body("a prompt to flush " * 20))
    n = len(fake.batches)
    r = await client.post("/flush_cache")
    assert r.status == 200
    await until(lambda: len(fake.batches) > n, timeout=1.0)
    assert any(isinstance(e, Cleared) for b in fake.batches[n:] for e in b.events)
    assert fake.held["w0"] == {}


async def test_an_agent_registers_its_role(monkeypatch):
    port = free_port()
    fake = FakeRouter()
    await fake.start(port)
    app = create_app(
        AgentConfig(kv_tokens=4_000, worker_id="w1", role="prefill"),
        routers=[f"http://127.0.0.1:{port}"],
        advertise_url="http://127.0.0.1:1",
    )
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        await until(lambda: fake.registrations)
        assert fake.registrations[0]["role"] == "prefill"
    finally:
        await srv.close()
        await fake.stop()
