"""The agent's HTTP API in-process (aiohttp test server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer

from radixfleet_tools.agent.server import AGENT_KEY, AgentConfig, create_app

pytestmark = pytest.mark.integration


@pytest.fixture
async def agent():
    servers = []

    async def start(**kw):
        app = create_app(AgentConfig(**kw))
        srv = TestServer(app, host="127.0.0.1")
        await srv.start_server()
        servers.append(srv)
        session = ClientSession(base_url=str(srv.make_url("")), timeout=ClientTimeout(total=20))
        servers.append(session)
        return session, app[AGENT_KEY]

    yield start
    for s in reversed(servers):
        await s.close()


def completion(prompt, **kw):
    return {"model": "llama-3-8b", "prompt": prompt, **kw}


async def sse(resp):
    out = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


async def test_completion_reports_cached_tokens(agent):
    c, a = await agent(kv_tokens=100_000)
    prompt = "You are a helpful assistant. " * 40
    r1 = await (await c.post("/v1/completions", json=completion(prompt, max_tokens=4))).json()
    r2 = await (await c.post("/v1/completions", json=completion(prompt, max_tokens=4))).json()
    n = r1["usage"]["prompt_tokens"]
    assert n == -(-len(prompt) // 4)
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert r1["choices"][0]["text"] == r2["choices"][0]["text"] and len(r1["choices"][0]["text"]) == 16
    assert r1["usage"]["completion_tokens"] == 4 and r1["choices"][0]["finish_reason"] == "length"
    a.sched.check()
    # no router to drain the event log: it is not kept at all (bounded memory)
    assert a.cache.pending_events == 0 and not a.cache.record_events


async def test_chat_stream_with_usage_and_sglang_fields(agent):
    c, a = await agent(kv_tokens=100_000)
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "return_hidden_states": False,
        "temperature": 0.0,
    }
    resp = await c.post("/v1/chat/completions", json=body)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    chunks = await sse(resp)
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[:-2] if ch["choices"])
    assert len(text) == 12
    usage = chunks[-2]["usage"]
    assert chunks[-2]["choices"] == [] and usage["completion_tokens"] == 3
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    # non-streamed answer is the same text (deterministic generation)
    body.pop("stream")
    r = await (await c.post("/v1/chat/completions", json=body)).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"] == text


async def test_generate_and_token_id_prompts(agent):
    c, a = await agent(kv_tokens=100_000)
    r = await (
        await c.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}})
    ).json()
    assert r["meta_info"]["prompt_tokens"] == 4 and r["meta_info"]["completion_tokens"] == 2
    r = await (await c.post("/v1/completions", json=completion([5, 6, 7, 8, 9], max_tokens=1))).json()
    assert r["usage"]["prompt_tokens"] == 5
    resp = await c.post(
        "/generate", json={"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    )
    chunks = await sse(resp)
    assert chunks[-1] == "[DONE]" and chunks[-2]["meta_info"]["completion_tokens"] == 3


async def test_small_max_tokens_and_prefill_only(agent):
    c, a = await agent(kv_tokens=100_000)
    for n in (0, 1):
        r = await (await c.post("/v1/completions", json=completion("warm me up " * 10, max_tokens=n))).json()
        assert r["usage"]["completion_tokens"] == n


async def test_tenants_do_not_share_cache(agent):
    c, a = await agent(kv_tokens=100_000)
    p = completion("shared system prompt " * 20, max_tokens=1)
    await c.post("/v1/completions", json=p, headers={"x-radixfleet-tenant": "acme"})
    r = await (await c.post("/v1/completions", json=p, headers={"x-radixfleet-tenant": "other"})).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = await (await c.post("/v1/completions", json=p, headers={"x-radixfleet-tenant": "acme"})).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # a LoRA adapter is its own namespace too
    r = await (
        await c.post(
            "/v1/completions", json={**p, "lora_path": "sql-lora"}, headers={"x-radixfleet-tenant": "acme"}
        )
    ).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


BAD = [
    (b"{not json", 400, "malformed_request"),
    (b"[1, 2]", 400, "malformed_request"),
    (json.dumps({"model": "llama-3-8b"}).encode(), 400, "malformed_request"),
    (json.dumps(completion(42)).encode(), 400, "malformed_request"),
    (json.dumps(completion("")).encode(), 400, "malformed_request"),
    (json.dumps(completion("x", max_tokens="5")).encode(), 400, "malformed_request"),
    (json.dumps(completion("x", max_tokens=-1)).encode(), 400, "malformed_request"),
    (json.dumps(completion("x", max_tokens=True)).encode(), 400, "malformed_request"),
    (json.dumps(completion("x", max_tokens=10**12)).encode(), 400, "context_length_exceeded"),
    (json.dumps(completion("x", stream="yes")).encode(), 400, "malformed_request"),
    (json.dumps(completion("x", n=3)).encode(), 400, "malformed_request"),
    (json.dumps(completion(["a", "b"])).encode(), 400, "malformed_request"),
    (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "not_found"),
    (json.dumps(completion("y" * 40_000)).encode(), 400, "context_length_exceeded"),
]


async def test_bad_input_gets_json_4xx_and_agent_keeps_serving(agent):
    c, a = await agent(kv_tokens=5_000)
    ok = await c.post("/v1/completions", json=completion("good", max_tokens=2))
    assert ok.status == 200
    for raw, status, code in BAD:
        resp = await c.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        body = await resp.json()
        assert resp.status == status, (raw[:60], body)
        assert body["error"]["code"] == code and body["error"]["message"] and "type" in body["error"]
    too_big = await (await c.post("/v1/completions", json=completion("y" * 40_000))).json()
    assert "5000" in too_big["error"]["message"]  # names the limit
    bad_chat = await c.post("/v1/chat/completions", json={"model": "llama-3-8b", "messages": "hi"})
    assert bad_chat.status == 400
    bad_gen = await c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -2}})
    assert bad_gen.status == 400
    missing = await c.get("/v1/nothing")
    assert missing.status == 404 and (await missing.json())["error"]["type"] == "not_found_error"
    r = await (await c.post("/v1/completions", json=completion("good", max_tokens=2))).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # 1 token prompt: nothing to reuse
    assert a.sched.stats.finished == 2
    a.sched.check()


async def test_probes_and_metrics(agent):
    c, a = await agent(kv_tokens=20_000)
    assert (await c.get("/health")).status == 200
    for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
        info = await (await c.get(path)).json()
        assert info["served_model_name"] == "llama-3-8b"
        # a model_path would make SGLang's router try to download a tokenizer off loopback
        assert "model_path" not in info and "tokenizer_path" not in info
    assert (await (await c.get("/server_info")).json())["max_total_num_tokens"] == 20_000
    assert (await (await c.get("/get_load")).json())[0]["num_reqs"] == 0
    models = await (await c.get("/v1/models")).json()
    assert models["data"][0]["id"] == "llama-3-8b"
    # no context length is enforced (the KV pool, 20,000 here, is not one): none claimed
    assert "max_model_len" not in models["data"][0]
    await c.post("/v1/completions", json=completion("metrics " * 30, max_tokens=1))
    await c.post("/v1/completions", json=completion("metrics " * 30, max_tokens=1))
    text = await (await c.get("/metrics")).text()
    for name in (
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "radixfleet_agent_prompt_tokens_total",
        "radixfleet_agent_cached_tokens_total",
        "radixfleet_agent_evicted_tokens_total",
        "radixfleet_agent_admission_refusals_total",
    ):
        assert name in text, name
    assert 'radixfleet_agent_cached_tokens_total{model_name="llama-3-8b"} 59.0' in text
    flush = await c.post("/flush_cache")
    assert flush.status == 200 and a.cache.total_tokens == 0


async def test_client_disconnect_cancels_and_frees_kv(agent):
    # L4 decode steps take ~55 ms: 2,000 tokens would run for minutes
    c, a = await agent(gpu="l4", kv_tokens=50_000)
    body = completion("long running " * 50, max_tokens=2000, stream=True)
    resp = await c.post("/v1/completions", json=body)
    await resp.content.readline()  # the first token arrived
    assert a.sched.running
    resp.close()
    for _ in range(100):
        if not a.sched.has_work():
            break
        await asyncio.sleep(0.02)
    assert not a.sched.has_work() and a.sched.stats.cancelled == 1
    assert a.pool.private == a.pool.reserved == 0 and a.cache.locked_tokens == 0
    # a non-streamed request whose client times out is cancelled too
    try:
        await c.post(
            "/v1/completions",
            json=completion("again " * 50, max_tokens=2000),
            timeout=ClientTimeout(total=0.3),
        )
    except asyncio.TimeoutError:
        pass
    for _ in range(100):
        if not a.sched.has_work():
            break
        await asyncio.sleep(0.02)
    assert not a.sched.has_work() and a.sched.stats.cancelled == 2
    a.sched.check()


async def test_openai_sdk_drop_in(agent):
    openai = pytest.importorskip("openai")
    c, a = await agent(kv_tokens=100_000)
    client = openai.AsyncOpenAI(base_url=str(c._base_url).rstrip("/") + "/v1", api_key="unused")
    try:
        msgs = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "Hi"}]
        first = await client.chat.completions.create(model="llama-3-8b", messages=msgs, max_tokens=4)
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And?"},
        ]
        second = await client.chat.completions.create(model="llama-3-8b", messages=msgs2, max_tokens=2)
        # the second turn reuses the first turn's prompt and all but its last generated token
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 3
        stream = await client.completions.create(
            model="llama-3-8b",
            prompt="abc",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts = [ch async for ch in stream]
        assert parts[-1].usage.completion_tokens == 2
    finally:
        await client.close()


async def test_engine_bug_fails_requests_instead_of_hanging(agent, monkeypatch):
    c, a = await agent(kv_tokens=10_000)
    real = a.sched.step
    calls = {"n": 0}

    def flaky(now):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(now)

    monkeypatch.setattr(a.sched, "step", flaky)
    r = await c.post("/v1/completions", json=completion("boom", max_tokens=2))
    assert r.status == 503 and "error" in await r.json()
    ok = await c.post("/v1/completions", json=completion("fine", max_tokens=2))
    assert ok.status == 200


async def test_tenant_header_must_be_utf8(agent):
    from radixfleet.keys import Endpoint
    from radixfleet.wire.errors import MalformedRequest
    from radixfleet_tools.agent.server import _parse

    c, a = await agent(kv_tokens=10_000)
    with pytest.raises(MalformedRequest, match="x-radixfleet-tenant"):
        _parse(a, Endpoint.COMPLETIONS, completion("x"), "caf\udcc3")
    r = await c.post("/v1/completions", json=completion("x"), headers={"x-radixfleet-tenant": "café"})
    assert r.status == 200


async def test_engine_config_change_flushes_the_tree(agent):
    c, a = await agent(kv_tokens=10_000)
    p = completion("rope sensitive context " * 10, max_tokens=1)
    await c.post("/v1/completions", json=p)
    assert a.cache.total_tokens > 0
    same = await (await c.post("/internal/v1/engine_config", json={"rope_scaling": None})).json()
    assert same["flushed"] is False and a.cache.total_tokens > 0
    yarn = {"rope_scaling": {"type": "yarn", "factor": 4.0}}
    r = await (await c.post("/internal/v1/engine_config", json=yarn)).json()
    assert r["flushed"] is True and a.cache.total_tokens == 0
    again = await (await c.post("/v1/completions", json=p)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    bad = await c.post("/internal/v1/engine_config", json={"nope": 1})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "rope_scaling"
    info = await (await c.get("/server_info")).json()
    assert info["fingerprint"][2] == '{"factor":4.0,"type":"yarn"}'


async def test_concurrent_burst_with_cancellations_leaves_no_leak(agent):
    c, a = await agent(kv_tokens=6_000)
    systems = ["system prompt A " * 30, "system prompt B " * 30]

    async def one(i):
        body = completion(
            systems[i % 2] + f"user {i} " * (i % 7 + 1), max_tokens=1 + i % 9, stream=bool(i % 2)
        )
        if i % 5 == 0:  # some clients give up early
            try:
                await c.post("/v1/completions", json=body, timeout=ClientTimeout(total=0.002))
            except asyncio.TimeoutError:
                pass
            return None
        r = await c.post("/v1/completions", json=body)
        assert r.status == 200
        return await (r.json() if not body["stream"] else sse(r))

    results = await asyncio.gather(*(one(i) for i in range(120)))
    for _ in range(100):
        if not a.sched.has_work():
            break
        await asyncio.sleep(0.02)
    a.sched.check()
    assert a.pool.private == a.pool.reserved == 0 and a.cache.locked_tokens == 0
    st = a.sched.stats
    assert st.finished + st.cancelled == st.submitted and st.finished >= 96
    assert st.cached_tokens > 0 and sum(r is not None for r in results) == 96


async def test_engine_config_change_and_flush_clear_the_dram_tier_too(agent):
    from radixfleet_tools.agent.dram_tier import DramConfig

    c, a = await agent(kv_tokens=10_000, dram=DramConfig(40_000))
    p = completion("rope sensitive context " * 200, max_tokens=1)
    await c.post("/v1/completions", json=p)
    a.sched.dram.advance(float("inf"))
    assert a.sched.dram.held_tokens > 0
    yarn = {"rope_scaling": {"type": "yarn", "factor": 4.0}}
    r = await (await c.post("/internal/v1/engine_config", json=yarn)).json()
    assert r["flushed"] is True and a.sched.dram.held_tokens == 0
    await c.post("/v1/completions", json=p)
    a.sched.dram.advance(float("inf"))
    assert a.sched.dram.held_tokens > 0
    assert (await c.post("/flush_cache")).status == 200
    assert a.sched.dram.held_tokens == 0


async def test_the_agents_span_joins_the_callers_trace_over_otlp(agent):
    """``--otlp-traces-endpoint``: one ``llm_request`` span per request, exported over
    OTLP/HTTP, a child of the caller's traceparent (a malformed one: a trace of its own)."""
    pytest.importorskip("opentelemetry.sdk")
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got: list = []

    async def traces(request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        got.extend(s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    sink = TestServer(app, host="127.0.0.1")
    await sink.start_server()
    try:
        c, _ = await agent(kv_tokens=100_000, otlp_traces_endpoint=str(sink.make_url("")).rstrip("/"))
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        for tp in (parent, "00-nonsense"):
            r = await c.post(
                "/v1/completions", json=completion("hello " * 30, max_tokens=3), headers={"traceparent": tp}
            )
            assert r.status == 200
        deadline = asyncio.get_running_loop().time() + 10
        while len(got) < 2:
            assert asyncio.get_running_loop().time() < deadline, "no spans exported"
            await asyncio.sleep(0.05)
        metrics = await (await c.get("/metrics")).text()
    finally:
        await sink.close()
    joined = next(s for s in got if s.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c")
    assert joined.name == "llm_request" and joined.parent_span_id.hex() == "b7ad6b7169203331"
    attrs = {a.key: a.value for a in joined.attributes}
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 3
    assert attrs["gen_ai.usage.prompt_tokens"].int_value > 0
    other = next(s for s in got if s is not joined)
    assert other.parent_span_id == b"" and other.trace_id != joined.trace_id
    assert 'radixfleet_agent_tracing_spans_total{outcome="exported"}' in metrics


def test_a_bad_otlp_endpoint_flag_is_one_line_and_exit_2(capsys):
    import argparse

    from radixfleet_tools.agent.cli import configure

    p = argparse.ArgumentParser(prog="radixfleet agent")
    configure(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--port", "1", "--otlp-traces-endpoint", "ftp://collector"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--otlp-traces-endpoint: expected an http:// or https:// URL" in err
