"""OpenTelemetry traces on a live router (radixfleet/server/tracing.py): one trace from the client's
traceparent through admission, keying, the route core and each upstream attempt to the
agent's own span, no prompt text or prefix hash on any span; a malformed traceparent
starts a new trace; a collector that is down or never answers drops spans, counted,
and no request waits for it."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from radixfleet.common.tracing import Tracing  # noqa: E402
from radixfleet.config import parse_config  # noqa: E402
from radixfleet.keys import Endpoint, request_key  # noqa: E402
from radixfleet.policies.base import Reason  # noqa: E402
from radixfleet.server.app import Router, RouterServer  # noqa: E402
from radixfleet_tools.harness.procs import free_port  # noqa: E402
from tests.router.fleet import HEALTH, PROMPT, fleet, until  # noqa: E402, F401 - the fixture

pytestmark = pytest.mark.integration

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
SECRET = "the-client-secret-question-xyzzy"
ADMISSION, KEYING, ROUTE = "radixfleet.admission", "radixfleet.keying", "radixfleet.route"


def _children(spans, parent) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        if s.parent is not None and s.parent.span_id == parent.context.span_id:
            out.setdefault(s.name, []).append(s)
    return out


def _values(span):
    yield from span.attributes.values()
    for e in span.events:
        yield e.name
        yield from (e.attributes or {}).values()
    yield span.name


async def test_a_request_is_one_trace_from_the_client_through_the_router_to_the_agent(fleet):
    mem = InMemorySpanExporter()
    tracing = Tracing(service_name="rf", exporter=mem, schedule_delay_s=0.05)
    try:
        await fleet.start({"policy": {"name": "prefix_load"}}, tracing=tracing)
        await fleet.agent("m", tracing=tracing)  # the agent's spans in the same exporter
        await fleet.routable(1)
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT + SECRET}], "max_tokens": 4}
        async with httpx.AsyncClient(base_url=fleet.base, timeout=10) as c:
            r = await c.post(
                "/v1/chat/completions",
                json={**body, "stream": True},
                headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
            )
            assert r.status_code == 200 and "[DONE]" in r.text
            r = await c.post(  # a malformed traceparent: a new trace
                "/v1/chat/completions", json=body, headers={"traceparent": f"00-{TRACE}-zz-01"}
            )
            assert r.status_code == 200
            r = await c.post("/v1/chat/completions", json={**body, "model": "nope"})  # the router's 404/503
            assert r.status_code in (404, 503)

        def roots():
            return [s for s in mem.get_finished_spans() if s.name in ("radixfleet.request", "llm_request")]

        await until(lambda: len(roots()) == 5, what="3 router and 2 agent root spans")
    finally:
        await tracing.aclose()
    spans = mem.get_finished_spans()
    joined = [s for s in spans if f"{s.context.trace_id:032x}" == TRACE]
    root = next(s for s in joined if s.name == "radixfleet.request")
    assert root.kind is SpanKind.SERVER and root.parent.is_remote and f"{root.parent.span_id:016x}" == PARENT
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "m" and root.attributes["radixfleet.stream"] is True
    kids = _children(joined, root)
    assert sorted(kids) == [
        "radixfleet.admission",
        "radixfleet.keying",
        "radixfleet.route",
        "radixfleet.upstream",
    ]
    route = kids["radixfleet.route"][0].attributes
    assert route["radixfleet.verdict"] == "route" and route["radixfleet.worker"] == "m"
    assert route["radixfleet.reason"] in {r.value for r in Reason}
    assert route["radixfleet.tokens.prompt"] > 0 and route["radixfleet.tokens.uncached"] > 0
    assert {"radixfleet.route.match_us", "radixfleet.route.choose_us", "radixfleet.route.place_us"} <= set(
        route
    )
    (up,) = kids["radixfleet.upstream"]
    assert up.kind is SpanKind.CLIENT and up.attributes["http.response.status_code"] == 200
    assert up.attributes["radixfleet.attempt"] == 1 and [e.name for e in up.events] == ["first_byte"]
    assert sorted(_children(joined, up)) == ["llm_request", "radixfleet.first_token", "radixfleet.stream"]
    (engine,) = _children(joined, up)["llm_request"]  # the agent's span, a child of the attempt
    assert engine.kind is SpanKind.SERVER and engine.resource.attributes["service.name"] == "rf"
    assert engine.attributes["gen_ai.usage.completion_tokens"] == 4
    assert engine.attributes["gen_ai.usage.prompt_tokens"] > 0
    # the request with a malformed traceparent: a trace of its own, not streamed
    other = [
        s for s in spans if s.name == "radixfleet.request" and s.context.trace_id != root.context.trace_id
    ]
    assert len(other) == 2 and all(s.parent is None for s in other)
    ok = next(s for s in other if s.attributes["http.response.status_code"] == 200)
    (up2,) = _children(spans, ok)["radixfleet.upstream"]
    assert sorted(_children(spans, up2)) == ["llm_request"]  # no first token: not a stream
    refused = next(s for s in other if s is not ok)
    # an unserved model is refused from its bytes before it is keyed (radixfleet.server.screen)
    assert sorted(_children(spans, refused)) == ["radixfleet.admission"]
    assert refused.attributes["http.response.status_code"] in (404, 503)
    # nothing on any span is prompt text or a prompt's hash (salted or not)
    hashes = set()
    for ns in ("", fleet.router.tenants.namespace_of("")):
        hashes |= set(request_key(Endpoint.CHAT, body, tenant=ns, block_bytes=128).hashes)
    for s in spans:
        for v in _values(s):
            if isinstance(v, str):
                assert SECRET not in v and "system prompt" not in v, (s.name, v)
                assert not any(f"{h:x}" in v or str(h) in v for h in hashes), (s.name, v)
            else:
                assert v not in hashes, (s.name, v)


class _Silent:
    """A collector that accepts connections and never answers."""

    def __init__(self) -> None:
        self.conns: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        async def hold(reader, writer) -> None:
            self.conns.append(writer)

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        for w in self.conns:
            w.close()
        self.server.close()
        await self.server.wait_closed()


async def _latencies(base: str, n: int) -> list[float]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    out: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:

        async def one() -> None:
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json=body)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text

        for _ in range(n // 4):
            await asyncio.gather(*(one() for _ in range(4)))
    return sorted(out)


@pytest.mark.parametrize("collector", ["down", "silent"])
async def test_a_collector_down_or_silent_costs_requests_nothing_and_drops_spans_counted(fleet, collector):
    silent = _Silent()
    port = await silent.start() if collector == "silent" else free_port()  # "down": nothing listens
    try:
        url = await fleet.upstream("u")
        tracing = {
            "enabled": True,
            "endpoint": f"http://127.0.0.1:{port}/v1/traces",
            "sample_ratio": 1.0,
            "max_queue_spans": 16,
            "export_timeout_s": 1.0,
        }
        await fleet.start({"workers": [{"url": url, "id": "u"}], "tracing": tracing})
        plain = RouterServer(  # the same fleet, tracing off: the baseline
            Router(parse_config({"health": HEALTH, "workers": [{"url": url, "id": "u"}]})),
            port=free_port(),
            admin_port=0,
        )
        base = f"http://127.0.0.1:{await plain.start()}"
        try:
            await fleet.routable(1)
            await until(lambda: len(plain.router.pool.views(time.monotonic())) >= 1, what="baseline routable")
            traced, off = [], []
            for _ in range(3):  # alternated, so machine noise falls on both alike
                traced += await _latencies(fleet.base, 40)
                off += await _latencies(base, 40)
        finally:
            await plain.aclose()
        traced.sort()
        off.sort()
        p50_t, p50_o = statistics.median(traced), statistics.median(off)
        print(f"collector {collector}: p50 {p50_t * 1e3:.2f} ms traced vs {p50_o * 1e3:.2f} ms off; "
              f"max {traced[-1] * 1e3:.1f} vs {off[-1] * 1e3:.1f} ms")  # fmt: skip
        # an export blocks its thread for up to export_timeout_s: no request waited for one
        assert traced[-1] < 0.9, f"a request waited for the collector: {traced[-1]:.3f}s"
        assert p50_t < 3 * p50_o + 0.02, (p50_t, p50_o)
        async with httpx.AsyncClient(base_url=fleet.admin) as c:
            metrics = (await c.get("/metrics")).text
        dropped = {
            line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("radixfleet_tracing_spans_total{")
        }
        assert dropped["exported"] == 0
        assert dropped["dropped_queue_full"] + dropped["dropped_export_failed"] > 0, dropped
        assert dropped["dropped_queue_full"] > 0  # 600 spans into a queue of 16
    finally:
        await silent.aclose() if collector == "silent" else None
