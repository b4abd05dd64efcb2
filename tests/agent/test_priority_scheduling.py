"""Engine-side priority: the scheduler's ``priority`` order (radixfleet_tools.agent.scheduler),
the agent's ``priority`` body field, the agent's announcement at registration, and the
router sending each request's class as vLLM's ``priority`` (radixfleet.engines.manager)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace

import pytest
from aiohttp import ClientSession, ClientTimeout, web
from aiohttp.test_utils import TestServer

from radixfleet.config import parse_config
from radixfleet.engines.kinds import WorkerKind
from radixfleet.engines.manager import Engines, engine_priority, sends_priority
from radixfleet.keys import Endpoint
from radixfleet.wire.bus_wire import build_agent, parse_agent
from radixfleet.wire.errors import MalformedRequest
from radixfleet.wire.events import EventBatch, Snapshot, parse_registration
from radixfleet_tools.agent import tokenizer as tk
from radixfleet_tools.agent.cost_model import CostModel
from radixfleet_tools.agent.kv_pool import KVPool
from radixfleet_tools.agent.radix_cache import RadixCache
from radixfleet_tools.agent.scheduler import SchedRequest, Scheduler, SchedulerConfig

# ------------------------------------------------------------------ the scheduler


def make(**cfg):
    cache = RadixCache(hash_stride=16, capacity_tokens=100_000)
    return Scheduler(CostModel("llama-3-8b", "h100"), cache, KVPool(100_000, cache), SchedulerConfig(**cfg))


def req(rid, priority, n=100, max_new=2):
    return SchedRequest(rid, "n", [rid + 1] * n, max_new, tk.generate(rid, max_new), None, priority)


def admitted_order(s, reqs, t=0.0):
    """Submits ``reqs`` at ``t`` behind a running request (so they all queue), runs to
    the end; the rids in the order their first token came (ties: step order)."""
    for r in reqs:
        s.submit(r, t)
        s.check()
    while s.has_work():
        t += s.step(t).duration_s
        s.check()
    return [r.rid for r in sorted(reqs, key=lambda r: (r.first_token_at, r.arrival))]


def test_priority_order_admits_lowest_value_first_ties_by_arrival():
    s = make(order="priority", max_running=1)
    reqs = [req(0, 2), req(1, 1), req(2, 2), req(3, 0), req(4, 1), req(5, 0)]
    order = admitted_order(s, reqs)
    assert order == [3, 5, 1, 4, 0, 2]


def test_priority_queue_is_sorted_at_submit_and_check_holds():
    s = make(order="priority")
    for rid, p in enumerate([1, 1, 0, 2, -5, 1, 0]):
        s.submit(req(rid, p), float(rid))
        s.check()
    queue = [(r.priority, r.rid) for r in s.waiting]
    assert queue == [(-5, 4), (0, 2), (0, 6), (1, 0), (1, 1), (1, 5), (2, 3)]
    s.cancel(s.waiting[2])
    s.check()
    assert [r.rid for r in s.waiting] == [4, 2, 0, 1, 5, 3]


def test_fcfs_and_lpm_ignore_priority():
    s = make(order="fcfs", max_running=1)
    assert admitted_order(s, [req(0, 2), req(1, 0), req(2, 1)]) == [0, 1, 2]


def test_a_running_request_is_not_preempted_by_a_higher_priority_arrival():
    s = make(order="priority", chunk_tokens=64, max_running=1)
    low = req(0, 5, n=1000, max_new=3)
    s.submit(low, 0.0)
    t = s.step(0.0).duration_s  # low's prefill is under way
    high = req(1, 0)
    s.submit(high, t)
    while s.has_work():
        t += s.step(t).duration_s
        s.check()
    assert low.finished_at <= high.first_token_at  # it waited for the batch slot


def test_check_catches_a_queue_out_of_priority_order():
    s = make(order="priority")
    s.submit(req(0, 1), 0.0)
    s.submit(req(1, 0), 0.0)
    s.waiting.reverse()
    with pytest.raises(AssertionError, match="priority, arrival"):
        s.check()


def test_random_priority_workload_keeps_invariants():
    rng = random.Random(5)
    s = make(order="priority", chunk_tokens=512, max_running=4)
    live = []
    t = 0.0
    for i in range(300):
        if rng.random() < 0.6:
            r = req(i, rng.choice((0, 1, 2)), n=rng.randrange(1, 600), max_new=rng.randrange(1, 20))
            s.submit(r, t)
            live.append(r)
        if live and rng.random() < 0.1:
            s.cancel(live.pop(rng.randrange(len(live))))
        if s.has_work():
            t += s.step(t).duration_s
        s.check()
    while s.has_work():
        t += s.step(t).duration_s
        s.check()
    assert s.pool.private == s.pool.reserved == 0 and s.cache.locked_tokens == 0
    assert s.stats.finished + s.stats.cancelled == s.stats.submitted


def test_unknown_order_lists_the_valid_ones():
    with pytest.raises(ValueError, match="fcfs, lpm, priority"):
        SchedulerConfig(order="prio")


# ------------------------------------------------------------------ registration


def test_registration_and_bus_carry_the_scheduling_policy():
    base = {"worker_id": "w1", "url": "http://127.0.0.1:9", "epoch": "e1"}
    assert parse_registration(base).scheduling_policy == ""
    assert parse_registration({**base, "scheduling_policy": "priority"}).scheduling_policy == "priority"
    for bad in (3, "no spaces", "x" * 40, "prïo"):
        with pytest.raises(MalformedRequest) as ei:
            parse_registration({**base, "scheduling_policy": bad})
        assert ei.value.param == "scheduling_policy"
    batch = EventBatch("w1", "http://127.0.0.1:9", "e1", 0, [Snapshot(blocks=[])], None)
    m = parse_agent(build_agent(batch, ["m"], 128, "both", "priority"), "7731")
    assert m.register and m.scheduling_policy == "priority"
    assert parse_agent(build_agent(batch, ["m"], 128), "7731").scheduling_policy == ""


# ------------------------------------------------------------------ forward_body


def _link(said: str, field: bool, kind: WorkerKind = WorkerKind.AGENT):
    return SimpleNamespace(
        worker=SimpleNamespace(scheduling_policy=said), spec=SimpleNamespace(priority_field=field), kind=kind
    )


def test_the_agents_announcement_decides_else_the_entry():
    assert sends_priority(_link("", True)) and not sends_priority(_link("", False))
    assert sends_priority(_link("priority", False))
    assert not sends_priority(_link("fcfs", True))  # it would refuse a non-zero value


def test_the_class_in_each_engines_own_order():
    vllm, sglang = _link("", True, WorkerKind.VLLM), _link("", True, WorkerKind.SGLANG)
    assert [engine_priority(vllm, r) for r in range(3)] == [0, 1, 2]  # lower first
    assert [engine_priority(_link("priority", False), r) for r in range(3)] == [0, 1, 2]
    assert [engine_priority(sglang, r) for r in range(3)] == [2, 1, 0]  # higher first
    assert engine_priority(_link("", False, WorkerKind.SGLANG), 0) is None  # not by priority
    assert engine_priority(vllm, None) is None and engine_priority(None, 0) is None


def test_forward_body_sets_the_class_where_the_worker_schedules_by_it_and_drops_it_elsewhere():
    fb = Engines.forward_body.__get__(object())  # uses nothing of the instance
    body = {"model": "m", "prompt": "x", "priority": 0}
    raw = json.dumps(body).encode()
    yes, no = _link("priority", False), _link("", False)
    out, strip = fb(yes, Endpoint.COMPLETIONS, body, raw, False, 2)
    assert json.loads(out) == {**body, "priority": 2} and strip is False
    assert fb(yes, Endpoint.COMPLETIONS, body, raw, False, 0) == (raw, False)  # already so
    # where the worker does not order by it, a client's value would jump its queue
    without = {"model": "m", "prompt": "x"}
    for link, rank in ((no, 2), (yes, None), (None, 2)):
        out, _ = fb(link, Endpoint.COMPLETIONS, body, raw, False, rank)
        assert json.loads(out) == without
        assert fb(link, Endpoint.COMPLETIONS, without, b"{}", False, rank) == (b"{}", False)
    for bad in (True, 0.0, None, "0"):  # only an int equal to the class is left as it is
        out, _ = fb(yes, Endpoint.COMPLETIONS, {**without, "priority": bad}, b"{}", False, 0)
        assert json.loads(out)["priority"] == 0 and type(json.loads(out)["priority"]) is int
    # /generate too: agents and SGLang read 'priority' there, each in its own order
    gen = {"text": "x", "priority": -1000}
    out, _ = fb(yes, Endpoint.GENERATE, gen, b"{}", False, 2)
    assert json.loads(out) == {"text": "x", "priority": 2}
    out, _ = fb(_link("", True, WorkerKind.SGLANG), Endpoint.GENERATE, gen, b"{}", False, 2)
    assert json.loads(out) == {"text": "x", "priority": 0}
    out, _ = fb(no, Endpoint.GENERATE, gen, b"{}", False, 2)
    assert json.loads(out) == {"text": "x"}
    out, strip = fb(yes, Endpoint.CHAT, {"model": "m", "stream": True}, b"", True, 1)
    assert json.loads(out) == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": 1,
    }
    assert strip is True


# ------------------------------------------------------------------ the agent's HTTP API


@pytest.mark.integration
async def test_agent_priority_field_bad_input_is_a_400_naming_it():
    from radixfleet_tools.agent.server import AgentConfig, create_app

    async def post(order: str, bodies: list[dict]) -> list[tuple[int, dict]]:
        app = create_app(AgentConfig(kv_tokens=100_000, scheduler=SchedulerConfig(order=order)))
        srv = TestServer(app, host="127.0.0.1")
        await srv.start_server()
        out = []
        try:
            async with ClientSession(base_url=str(srv.make_url("")), timeout=ClientTimeout(total=20)) as c:
                for b in bodies:
                    async with c.post("/v1/completions", json=b) as r:
                        out.append((r.status, await r.json()))
        finally:
            await srv.close()
        return out

    body = {"model": "llama-3-8b", "prompt": "hello there", "max_tokens": 2}
    res = await post(
        "priority",
        [
            {**body, "priority": "high"},
            {**body, "priority": True},
            {**body, "priority": 1.5},
            {**body, "priority": 2**63},
            {**body, "priority": -3},
            {**body, "priority": None},
        ],
    )
    for status, data in res[:4]:
        assert status == 400 and data["error"]["param"] == "priority", data
    assert "must be an integer" in res[0][1]["error"]["message"]
    assert [s for s, _ in res[4:]] == [200, 200]
    res = await post("fcfs", [{**body, "priority": 1}, {**body, "priority": 0}])
    assert res[0][0] == 400 and res[0][1]["error"]["param"] == "priority"
    assert "--schedule priority" in res[0][1]["error"]["message"]
    assert res[1][0] == 200


# ------------------------------------------------------------------ the router on the wire


class RecordingWorker:
    """An OpenAI worker serving ``model`` that records each body it gets."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.bodies: list[dict] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def completions(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response(
            {
                "choices": [{"text": "ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app


@pytest.mark.integration
async def test_router_sends_the_class_only_to_workers_that_schedule_by_it():
    from radixfleet.server.app import Router, RouterServer

    a, b = RecordingWorker("ma"), RecordingWorker("mb")
    runners = []
    urls = []
    for w in (a, b):
        runner = web.AppRunner(w.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    cfg = parse_config(
        {
            "workers": [
                {"url": urls[0], "kind": "openai", "model": "ma"},
                {"url": urls[1], "kind": "openai", "model": "mb"},
            ],
            "models": {"ma": {"priority_field": True}},
            "tenancy": {"default_priority": "critical"},
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    try:
        ws = [router.pool.get(w.id) for w in cfg.workers]
        for _ in range(100):
            if all(w.routable(time.monotonic()) and w.models and w.engine is not None for w in ws):
                break
            await asyncio.sleep(0.05)
        async with ClientSession(timeout=ClientTimeout(total=20)) as s:
            for model, cls, own in (
                ("ma", "sheddable", None),
                ("ma", "standard", 0),  # the client's own value gives way to its class
                ("ma", None, None),  # the default class
                ("mb", "sheddable", 0),  # an fcfs worker: no priority, the client's dropped
            ):
                body = {"model": model, "prompt": "hi", "max_tokens": 1}
                if own is not None:
                    body["priority"] = own
                headers = {"x-radixfleet-priority": cls} if cls else {}
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
        assert [x.get("priority") for x in a.bodies] == [2, 1, 0]
        assert [x.get("priority", "absent") for x in b.bodies] == ["absent"]
    finally:
        await server.aclose()
        for r in runners:
            await r.cleanup()


# ------------------------------------------------------------------ the bench's flags


@pytest.mark.parametrize(
    "flag", ["--burst 0", "--repeats 0", "--chunk-tokens 0", "--queue-scale 1,2", "--fair-share 1.5"]
)
def test_bench_priority_refuses_bad_flags_before_any_process(flag, capsys):
    import argparse

    from radixfleet_tools.bench import priority

    p = argparse.ArgumentParser()
    priority.configure(p)
    args = p.parse_args(["--scenario", "queue", *flag.split()])
    try:
        code = priority.run(args)
    except SystemExit as exc:  # _three's exit
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("radixfleet bench priority: error:") and err.count("\n") == 1
