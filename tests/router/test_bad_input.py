"""Nothing a client or a peer can send gets a 500 or a traceback: malformed JSON and
Unicode, bad credentials and chunking, out-of-range load reports, slow heads and bodies,
overload (shed by default, with Retry-After), unbounded identifiers; and the metrics stay
hygienic while it happens.

A real router (the raw front, in-process, on a free port) in front of real
upstreams (``radixfleet_tools.bench.proxy.upstream_app``) or real agents
(``radixfleet_tools.agent.server.create_app``, in-process). ``fleet`` and the raw-HTTP helpers
here are shared by the router's other in-process test files."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from radixfleet.common.jsonbody import MAX_DEPTH, loads, nesting_depth
from radixfleet.config import ConfigError, parse_config
from radixfleet.keys import Endpoint, request_key
from radixfleet.route.shedding import QueueMark, Shedder
from radixfleet.wire.errors import MalformedRequest, Overloaded
from radixfleet.wire.events import Load
from radixfleet.wire.identifiers import MAX_ID_CHARS
from radixfleet_tools.agent.scheduler import SchedulerConfig
from radixfleet_tools.agent.server import AGENT_KEY, AgentConfig, create_app
from radixfleet_tools.harness.procs import free_port
from tests.router.fleet import (
    PROMPT,
    Fleet,
    fleet,  # noqa: F401  (fixtures)
    serve_app,
)


async def one_router(fleet: Fleet, **raw) -> str:
    """A router in front of one upstream serving model "m"; returns its base URL."""
    url = await fleet.upstream("u")
    await fleet.start({"workers": [{"url": url, "id": "u"}], **raw})
    await fleet.routable(1)
    return url


async def trickle(port: int, data: bytes, gap_s: float, timeout_s: float) -> bytes:
    """Sends ``data`` one byte every ``gap_s`` while reading; returns what the server
    sent until it closed the connection (or ``timeout_s``)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)

    async def send():
        for i in range(len(data)):
            w.write(data[i : i + 1])
            await asyncio.sleep(gap_s)

    sender = asyncio.create_task(send())
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(r.read(65536), deadline - time.monotonic())
            except (asyncio.TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            out += chunk
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        w.close()
    return out


async def raw_http(port: int, data: bytes | list[bytes], *, gap_s: float = 0.0, read_s: float = 3.0) -> bytes:
    """Sends ``data`` (pieces ``gap_s`` apart) on one connection; reads until EOF,
    ``read_s`` after the last piece, or a complete JSON answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    out = b""
    try:
        for piece in data if isinstance(data, list) else [data]:
            if w.is_closing():
                break
            w.write(piece)
            try:
                await w.drain()
            except ConnectionError:
                break
            if gap_s:
                await asyncio.sleep(gap_s)
        deadline = time.monotonic() + read_s
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(r.read(65536), deadline - time.monotonic())
            except (asyncio.TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            out += chunk
            head, _, body = out.partition(b"\r\n\r\n")
            if b"content-length:" in head.lower() and body:
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    finally:
        w.close()
    return out


def status_of(out: bytes) -> int:
    assert out.startswith(b"HTTP/1."), out[:200]
    return int(out.split(b" ", 2)[1])


def json_body_of(out: bytes) -> dict:
    return json.loads(out.partition(b"\r\n\r\n")[2])


# ================================================================= no 500s

LONE = "\\ud800"  # a lone surrogate, as a JSON escape (valid JSON, not valid Unicode)
SURROGATE_CASES = {
    "model": ("/v1/chat/completions", '{"model":"%s","messages":[{"role":"user","content":"hi"}]}' % LONE),
    "lora_path": ("/v1/completions", '{"model":"m","prompt":"hi","lora_path":"%s"}' % LONE),
    "role": ("/v1/chat/completions", '{"model":"m","messages":[{"role":"%s","content":"hi"}]}' % LONE),
    "tools": (
        "/v1/chat/completions",
        '{"model":"m","messages":[{"role":"user","content":"hi"}],'
        '"tools":[{"type":"function","function":{"name":"%s"}}]}' % LONE,
    ),
    "tool_calls": (
        "/v1/chat/completions",
        '{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"%s"}]}]}' % LONE,
    ),
    "media": (
        "/v1/chat/completions",
        '{"model":"m","messages":[{"role":"user","content":'
        '[{"type":"image_url","image_url":{"url":"%s"}}]}]}' % LONE,
    ),
}


@pytest.mark.parametrize("field", sorted(SURROGATE_CASES))
def test_lone_surrogates_key_without_error(field):
    path, body = SURROGATE_CASES[field]
    endpoint = Endpoint(path)
    key = request_key(endpoint, json.loads(body), tenant="t\udcff")  # and in the tenant
    assert key.data and key.hashes is not None


@pytest.mark.integration
async def test_lone_surrogates_are_never_500(fleet):
    await one_router(fleet)
    fleet.past_grace()
    async with httpx.AsyncClient() as c:
        for field, (path, body) in sorted(SURROGATE_CASES.items()):
            r = await c.post(
                fleet.base + path, content=body.encode(), headers={"content-type": "application/json"}
            )
            assert r.status_code < 500, (field, r.status_code, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["message"], field
        # the unknown (surrogate) model is a 404 naming the served one
        r = await c.post(fleet.base + "/v1/chat/completions", content=SURROGATE_CASES["model"][1].encode())
        assert r.status_code == 404 and "'m'" in r.json()["error"]["message"]


DEEP = ("[" * 5000 + "]" * 5000).encode()


def test_bounded_depth_parse():
    assert nesting_depth(b'{"a": "[[[[", "b": [[{}]]}') == 4
    assert nesting_depth(b'["\\\\", ["\\"[[["]]') == 2
    assert loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    for bad, needle in (
        (DEEP, "nested deeper than 128"),
        (b"[" * 129 + b"]" * 129, "deeper"),
        (b'{"a": NaN}', "NaN is not JSON"),
        (b"[Infinity]", "Infinity"),
        (b"[1e400]", "not a finite number"),
        (b"\xff", "not valid UTF-8"),
        (b"1" * 5000, "not valid JSON"),
    ):
        with pytest.raises(MalformedRequest, match=needle):
            loads(bad)
    # brackets inside strings never count
    assert loads(json.dumps({"s": "[" * 5000}).encode())["s"] == "[" * 5000


@pytest.mark.integration
async def test_deep_json_is_400_on_every_json_endpoint(fleet):
    await one_router(fleet)
    agent_url, _ = await fleet.agent("m", register=False)
    async with httpx.AsyncClient(timeout=10) as c:
        for url in (
            fleet.base + "/v1/completions",
            fleet.base + "/v1/chat/completions",
            fleet.base + "/generate",
            fleet.admin + "/admin/workers",
            fleet.base + "/internal/v1/register",
            fleet.base + "/internal/v1/events",
            fleet.admin + "/admin/workers/u/drain",
            agent_url + "/v1/completions",
            agent_url + "/internal/v1/engine_config",
        ):
            r = await c.post(url, content=DEEP, headers={"content-type": "application/json"})
            assert r.status_code == 400, (url, r.status_code, r.text[:200])
            assert "nested deeper" in r.json()["error"]["message"], url


@pytest.mark.integration
async def test_non_utf8_credentials_are_401(fleet, monkeypatch):
    monkeypatch.setenv("RADIXFLEET_ADMIN_TOKEN", "adm")
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "agt")
    url = await fleet.upstream("u")
    await fleet.start(
        {
            "workers": [{"url": url}],
            "keys": {"tenant": {"source": "api_key", "api_keys": [{"tenant": "acme", "key": "k-acme"}]}},
        }
    )
    await fleet.routable(1)
    bad = b"Bearer \xff\xfe"
    for port, req in (
        (fleet.admin_port, b"GET /admin/workers HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n\r\n" % bad),
        (fleet.admin_port, b"GET /admin/index HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n\r\n" % bad),
        (
            fleet.port,
            b"POST /internal/v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n"
            b"Content-Length: 2\r\n\r\n{}" % bad,
        ),
    ):
        out = await raw_http(port, req)
        assert status_of(out) == 401, out[:300]
    body = b'{"model":"m","prompt":"hi"}'
    for header in (b"x-api-key: \xff\xfe", b"Authorization: Bearer \xc3\x28"):
        out = await raw_http(
            fleet.port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (header, len(body), body),
        )
        assert status_of(out) == 401, out[:300]
        assert json_body_of(out)["error"]["code"] == "unauthorized"


@pytest.mark.integration
async def test_bad_ipv6_worker_url_is_400(fleet):
    await one_router(fleet)
    async with httpx.AsyncClient() as c:
        r = await c.post(fleet.admin + "/admin/workers", json={"url": "http://[::1"})
        assert r.status_code == 400 and "Invalid IPv6 URL" in r.json()["error"]["message"]
        r = await c.post(
            fleet.base + "/internal/v1/register", json={"worker_id": "a", "url": "http://[::1", "epoch": "e"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    with pytest.raises(ConfigError, match=r"workers\[0\]\.url: invalid URL"):
        parse_config({"workers": [{"url": "http://[::1"}]})


@pytest.mark.integration
async def test_bad_chunk_size_is_json_400_on_both_listeners(fleet, caplog):
    await one_router(fleet)
    caplog.set_level(logging.DEBUG)
    for port, path in (
        (fleet.port, b"/health"),
        (fleet.port, b"/admin/workers"),
        (fleet.port, b"/nope"),
        (fleet.admin_port, b"/admin/workers"),
        (fleet.admin_port, b"/nope"),
    ):
        out = await raw_http(
            port,
            b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n" % path,
        )
        # 400 when the bad chunk is parsed first; the route's own 4xx (404, 405) when
        # the head alone arrived first and was answered: JSON either way, never 5xx
        assert 400 <= status_of(out) < 500, out
        assert json_body_of(out)["error"]["code"], out
    # and when the broken chunk surely arrives after the head was answered
    for port in (fleet.port, fleet.admin_port):
        out = await raw_http(
            port,
            [b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", b"zz\r\n"],
            gap_s=0.2,
        )
        assert 400 <= status_of(out) < 500, out
    # a data-plane body's broken chunk: the front's own 400, counted
    out = await raw_http(
        fleet.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nab\r\n0\r\n\r\n",
    )
    assert status_of(out) == 400 and json_body_of(out)["error"]["code"] == "bad_http", out
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info
    ]
    assert fleet.router.metrics.bad_http.labels("400")._value.get() >= 1


@pytest.mark.integration
async def test_long_request_id_is_not_passed_on(fleet):
    await fleet.start({})
    await fleet.agent("m")
    await fleet.routable(1)
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(
            fleet.base + "/v1/completions",
            headers={"x-request-id": "r" * 10_000},
            json={"model": "m", "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        assert len(r.headers["x-request-id"]) < 100
        r = await c.post(
            fleet.base + "/v1/completions",
            headers={"x-request-id": "ok-1.2"},
            json={"model": "m", "prompt": "hi", "max_tokens": 2},
        )
        assert r.headers["x-request-id"] == "ok-1.2"


# ============================================ reported load


@pytest.mark.integration
async def test_out_of_range_load_reports_are_refused_and_routing_survives(fleet):
    url = await one_router(fleet)
    other = await fleet.upstream("v")
    reg = {"worker_id": "ag", "url": other, "epoch": "e1", "models": ["m"]}
    async with httpx.AsyncClient() as c:
        assert (await c.post(fleet.base + "/internal/v1/register", json=reg)).status_code == 200
        seq = 0
        for field, value in (
            ("queued_tokens", "1" + "0" * 400),
            ("queued_tokens", "1e400"),
            ("queued_requests", "NaN"),
            ("kv_used_tokens", "Infinity"),
            ("prefill_tokens_per_s", "NaN"),
            ("prefill_tokens_per_s", "1e13"),
            ("queued_tokens", "-1"),
            ("running_requests", "2.5"),
        ):
            raw = '{"worker_id":"ag","url":"%s","epoch":"e1","seq":%d,"events":[],"load":{"%s":%s}}' % (
                other,
                seq,
                field,
                value,
            )
            r = await c.post(fleet.base + "/internal/v1/events", content=raw.encode())
            assert r.status_code == 400, (field, value, r.status_code, r.text)
            assert "load" in r.json()["error"]["message"] or "JSON" in r.json()["error"]["message"]
        for _ in range(6):  # every policy decision still works
            r = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200, r.text
    assert url


# ========================================================== shedding


@pytest.mark.integration
async def test_overload_is_shed_by_default_with_retry_after(fleet):
    await one_router(fleet)  # default limits
    other = await fleet.upstream("v")
    async with httpx.AsyncClient() as c:
        r = await c.post(fleet.admin + "/admin/workers/u/drain", json={"drain": True})
        assert r.status_code == 200
        reg = {"worker_id": "ag", "url": other, "epoch": "e1", "models": ["m"]}
        assert (await c.post(fleet.base + "/internal/v1/register", json=reg)).status_code == 200

        async def report(queued_tokens):
            b = {
                "worker_id": "ag",
                "url": other,
                "epoch": "e1",
                "seq": report.seq,
                "events": [],
                "load": {
                    "queued_requests": 8,
                    "queued_tokens": queued_tokens,
                    "prefill_tokens_per_s": 10_000.0,
                },
            }
            report.seq += 1
            assert (await c.post(fleet.base + "/internal/v1/events", json=b)).status_code == 200

        report.seq = 0
        await report(0)
        ok = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": PROMPT})
        assert ok.status_code == 200
        await report(50_000)  # 5 s of prefill queued on the only worker
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": PROMPT})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 4 and r.json()["error"]["code"] == "overloaded"
        assert fleet.router.metrics.shed._value.get() == 1
        await report(10)
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": PROMPT})
        assert r.status_code == 200


def test_shedder_bound_follows_the_typical_request():
    class W:  # the worker shape the shedder reads (radixfleet.fleet.pool.Worker)
        models = ()
        base_prefill = 1000.0
        load_until = 10.0
        id = "w"
        in_flight = remote_in_flight = in_flight_tokens = remote_tokens = 0

        def serves(self, model, adapter):
            return True

        def __init__(self, queued):
            self.load = Load(queued_tokens=queued, prefill_tokens_per_s=1000.0)
            self.mark = QueueMark()  # reported at t=0, nothing picked since

    s = Shedder(2.0, 0.05)
    assert s.check([W(0)], "m", None, 500, 0.0) is None  # learns: typical 0.5 s
    assert s.bound_s() == pytest.approx(1.0)
    s.shed_at = 0.0  # the fleet shed a moment ago: the plain bound, not a calm fleet's
    assert s.check([W(900)], "m", None, 500, 0.0) is None
    exc = s.check([W(3000), W(1500)], "m", None, 500, 0.0)
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(0.5)
    stale = W(10**6)
    stale.load_until = 0.0
    assert s.check([W(3000), stale], "m", None, 500, 1.0) is None  # no evidence: admit
    assert Shedder(0.0, 0.05).check([W(10**9)], "m", None, 1, 0.0) is None  # off


@pytest.mark.integration
async def test_agent_wait_queue_is_bounded():
    app = create_app(
        AgentConfig(
            model="llama-3-8b",
            gpu="l4",
            kv_tokens=100_000,
            scheduler=SchedulerConfig(max_running=1, max_waiting=2),
        )
    )
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    url = str(srv.make_url("/v1/completions"))
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            reqs = [
                asyncio.create_task(
                    c.post(url, json={"model": "llama-3-8b", "prompt": PROMPT, "max_tokens": 8})
                )
                for _ in range(6)
            ]
            rs = await asyncio.gather(*reqs)
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 429 in codes, codes  # 1 running + 2 waiting at most
        shed = next(r for r in rs if r.status_code == 429)
        assert int(shed.headers["Retry-After"]) >= 1 and shed.json()["error"]["code"] == "overloaded"
        assert len(app[AGENT_KEY].sched.waiting) == 0
    finally:
        await srv.close()
    import argparse

    from radixfleet_tools.agent.cli import build_config, configure

    p = argparse.ArgumentParser()
    configure(p)
    assert build_config(p.parse_args(["--port", "1"])).scheduler.max_waiting == 4 * 256


@pytest.mark.integration
async def test_head_and_body_deadlines(fleet):
    await one_router(fleet, limits={"header_timeout_s": 0.5, "body_timeout_s": 0.5})
    t0 = time.monotonic()
    # one byte of head every 0.2 s: the head never completes in time
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    out = await trickle(fleet.port, head, 0.2, 10.0)
    assert status_of(out) == 408 and b"head not received within 0.5s" in out, out
    assert time.monotonic() - t0 < 4
    # a head, then a body that stops short
    out = await raw_http(
        fleet.port,
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model"',
        read_s=3.0,
    )
    assert status_of(out) == 408 and b"body not received" in out, out
    # the same on the agent API, and on the admin listener
    for port, path in ((fleet.port, b"/internal/v1/events"), (fleet.admin_port, b"/admin/workers")):
        out = await raw_http(
            port,
            b'POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"url"' % path,
            read_s=3.0,
        )
        assert status_of(out) == 408, out


@pytest.mark.integration
async def test_no_503_without_retry_after(fleet):
    dead = f"http://127.0.0.1:{free_port()}"
    await fleet.start({"workers": [{"url": dead}]})
    async with httpx.AsyncClient() as c:
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        r = await c.get(fleet.base + "/readiness")
        assert r.status_code == 503 and r.headers["Retry-After"]


@pytest.mark.integration
async def test_a_workers_503_passes_through_with_retry_after(fleet):
    async def busy(request):
        await request.read()
        return web.json_response({"error": {"message": "busy"}}, status=503)

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", busy)
    app.router.add_get("/health", health)
    runner, url = await serve_app(app)
    fleet.closers.append(runner.cleanup)
    await fleet.start({"workers": [{"url": url, "id": "b"}], "breaker": {"failure_threshold": 50}})
    await fleet.routable(1)
    async with httpx.AsyncClient() as c:
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"


# ======================================================== identifiers


@pytest.mark.integration
async def test_identifiers_are_bounded(fleet, tmp_path):
    url = await one_router(fleet)
    other = await fleet.upstream("v")
    huge = "w" * 100_000
    async with httpx.AsyncClient() as c:
        r = await c.post(
            fleet.base + "/internal/v1/register", json={"worker_id": huge, "url": other, "epoch": "e"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "worker_id"
        for bad in (
            {"worker_id": "a/b", "url": other, "epoch": "e"},
            {"worker_id": "a", "url": other, "epoch": "e" * 200},
            {"worker_id": "a", "url": other, "epoch": "e", "models": ["m"] * 65},
            {"worker_id": "a", "url": other, "epoch": "e", "models": ["x" * 300]},
            {"worker_id": "a", "url": "http://h:1/" + "p" * 3000, "epoch": "e"},
        ):
            r = await c.post(fleet.base + "/internal/v1/register", json=bad)
            assert r.status_code == 400, (str(bad)[:80], r.text)
        r = await c.post(fleet.admin + "/admin/workers", json={"url": other, "id": huge})
        assert r.status_code == 400
        longest = "w" * MAX_ID_CHARS
        r = await c.post(fleet.admin + "/admin/workers", json={"url": other, "id": longest})
        assert r.status_code == 201
        assert len((await c.get(fleet.admin + "/metrics")).text) < 100_000
        r = await c.delete(fleet.admin + "/admin/workers/" + longest)
        assert r.status_code == 200
    with pytest.raises(ConfigError, match=r"workers\[0\]\.id"):
        parse_config({"workers": [{"url": url, "id": huge}]})


# ============================================================ metrics


@pytest.mark.integration
async def test_metrics_hygiene(fleet):
    async def fail(request):
        await request.read()
        # a worker refusing (503: it did not take the request) is retried elsewhere
        return web.json_response({"error": {"message": "boom"}}, status=503)

    async def health(request):
        return web.json_response({"data": []})

    bad = web.Application()
    bad.router.add_post("/v1/completions", fail)
    bad.router.add_get("/health", health)
    runner, bad_url = await serve_app(bad)
    fleet.closers.append(runner.cleanup)
    good = await fleet.upstream("good", chunks=2)
    await fleet.start(
        {
            "workers": [{"url": bad_url, "id": "bad"}, {"url": good, "id": "good"}],
            "policy": {"name": "round_robin"},
            "breaker": {"failure_threshold": 50},
            "index": {"max_bytes": 2000},
        }
    )
    await fleet.routable(2)
    async with httpx.AsyncClient() as c:
        for i in range(4):
            r = await c.post(
                fleet.base + "/v1/completions",
                json={"model": "m", "prompt": f"{i} " + PROMPT, "stream": i % 2 == 0},
            )
            assert r.status_code == 200 and r.headers["x-radixfleet-worker"] == "good"
        text = (await c.get(fleet.admin + "/metrics")).text
    assert "# TYPE radixfleet_index_evicted_entries_total counter" in text
    evicted = [l for l in text.splitlines() if l.startswith("radixfleet_index_evicted_entries_total")]
    assert evicted and float(evicted[0].split()[1]) > 0  # the tiny index budget evicted
    assert "process_resident_memory_bytes" in text and "python_gc_objects_collected_total" in text
    assert "_created" not in text
    # 4 client requests, each answered once by "good" after "bad" failed first (the
    # round-robin cursor moves on the retry too): 4 outcomes, 8 attempts
    outcomes = [l for l in text.splitlines() if l.startswith("radixfleet_requests_total")]
    assert outcomes == ['radixfleet_requests_total{reason="fallback",status="200",worker="good"} 4.0']
    assert 'radixfleet_upstream_attempts_total{outcome="503",worker="bad"} 4.0' in text
    assert 'radixfleet_upstream_attempts_total{outcome="200",worker="good"} 4.0' in text
    assert "radixfleet_ttft_seconds_count 2.0" in text
    assert "radixfleet_matched_prefix_tokens_count 4.0" in text
