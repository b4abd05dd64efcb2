"""The endpoint picker's protocol translation (radixfleet/gateway/protocol.py) and its streams
(radixfleet/gateway/server.py ``Picker``) on hand-made ext_proc messages: the router's own
pool, route core and ledger, no Envoy, no server, no socket."""

from __future__ import annotations

import asyncio
import json

import pytest

from radixfleet.config import parse_config
from radixfleet.fleet.pool import HealthState
from radixfleet.gateway import protocol as P
from radixfleet.gateway.endpoints import Endpoints
from radixfleet.gateway.server import Picker
from radixfleet.server.app import Router
from radixfleet.wire.errors import Overloaded

ep = P.pb().ep
core = P.pb().core
struct = P.pb().struct

PROMPT = "The shared system prompt of the acme tenant, long enough to fill blocks. " * 6


# ------------------------------------------------------------------ messages


def req_headers(path="/v1/chat/completions", method="POST", eos=False, subset=None, **extra):
    hv = [
        core.HeaderValue(key=":path", raw_value=path.encode()),
        core.HeaderValue(key=":method", raw_value=method.encode()),
    ]
    hv += [core.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in extra.items()]
    r = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=core.HeaderMap(headers=hv), end_of_stream=eos)
    )
    if subset is not None:
        s = struct.Struct()
        s.update({P.SUBSET: list(subset)})
        r.metadata_context.filter_metadata[P.SUBSET_NAMESPACE].CopyFrom(s)
    return r


def req_body(data: bytes, eos: bool):
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


def resp_headers(status=200, upstream: str | None = None, eos=False):
    hv = [core.HeaderValue(key=":status", raw_value=str(status).encode())]
    r = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=core.HeaderMap(headers=hv), end_of_stream=eos)
    )
    if upstream is not None:
        s = struct.Struct()
        s.update({P.UPSTREAM_ADDRESS: upstream})
        r.attributes["envoy.filters.http.ext_proc"].CopyFrom(s)
    return r


def resp_body(data: bytes, eos: bool):
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=eos))


def chat(stream: bool = False, **kw) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4,
            "stream": stream,
            **kw,
        }
    ).encode()


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


ROLE = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
TOKEN = {"choices": [{"delta": {"content": "Hello"}}]}
USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 120, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 64}},
}


# ---------------------------------------------------------------- a picker


def make_picker(buffered=False, **raw) -> Picker:
    workers = [
        {"url": "http://127.0.0.1:9001", "id": "a", "model": "m"},
        {"url": "http://127.0.0.1:9002", "id": "b", "model": "m"},
    ]
    router = Router(parse_config({"workers": workers, **raw}))
    for w in router.pool:
        router.pool._set_health(w, HealthState.HEALTHY)
        w.models = ("m",) if not w.models else w.models
    router.pool.started -= 3600  # past the start-up grace
    return Picker(router, Endpoints(), buffered=buffered, header_list=True)


class Stream:
    """Drives one ``Process`` stream message by message, as Envoy would."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.q: asyncio.Queue = asyncio.Queue()
        self.gen = picker.Process(self._it(), None)
        self.task: asyncio.Task | None = None

    async def _it(self):
        while True:
            m = await self.q.get()
            if m is None:
                return
            yield m

    async def send(self, msg, expect: int) -> list:
        """Sends ``msg``; returns the ``expect`` answers it gets."""
        await self.q.put(msg)
        return [await asyncio.wait_for(self.gen.__anext__(), 2.0) for _ in range(expect)]

    async def close(self) -> None:
        await self.gen.aclose()


def header(resp, name: str) -> str | None:
    for which in ("request_headers", "request_body"):
        if resp.HasField(which):
            for h in getattr(resp, which).response.header_mutation.set_headers:
                if h.header.key == name:
                    return h.header.raw_value.decode()
    return None


def counted(picker: Picker) -> dict:
    return {w.id: (w.in_flight, w.in_flight_tokens, w.in_flight_kv) for w in picker.router.pool}


def zero(picker: Picker) -> bool:
    return all(v == (0, 0, 0) for v in counted(picker).values()) and not picker.open


# ------------------------------------------------------------------- protocol


def test_headers_subset_and_served_are_read_from_the_messages():
    r = req_headers(subset=["10.0.0.1:8000", "10.0.0.2:8000"], x_tenant="t1")
    h = P.headers_of(r.request_headers)
    assert h[":path"] == "/v1/chat/completions" and h["x-tenant"] == "t1"
    assert P.subset_of(r) == frozenset({"10.0.0.1:8000", "10.0.0.2:8000"})
    assert P.subset_of(req_headers()) is None
    one = ep.ProcessingRequest()
    one.metadata_context.filter_metadata[P.SUBSET_NAMESPACE].update({P.SUBSET: "10.0.0.3:1, 10.0.0.4:2"})
    assert P.subset_of(one) == frozenset({"10.0.0.3:1", "10.0.0.4:2"})
    assert P.served_of(resp_headers(upstream="127.0.0.1:9002")) == "127.0.0.1:9002"
    fed = resp_headers(upstream="127.0.0.1:9002")
    fed.metadata_context.filter_metadata[P.LB_NAMESPACE].update({P.SERVED: "127.0.0.1:9001"})
    assert P.served_of(fed) == "127.0.0.1:9001"  # the data plane's report first
    assert P.served_of(resp_headers()) is None


def test_the_pick_is_the_header_and_the_metadata_in_order():
    eps = ["10.0.0.1:8000", "[fd00::1]:8000"]
    (buffered,) = P.picked(
        eps, body=b"{}", buffered=True, headers=[("x-request-id", "r1")], remove=["authorization"]
    )
    assert buffered.HasField("request_body")
    assert header(buffered, P.DESTINATION) == "10.0.0.1:8000,[fd00::1]:8000"
    assert header(buffered, "content-length") == "2"
    assert buffered.request_body.response.body_mutation.body == b"{}"
    assert list(buffered.request_body.response.header_mutation.remove_headers) == ["authorization"]
    md = buffered.dynamic_metadata.fields[P.LB_NAMESPACE].struct_value.fields[P.DESTINATION].string_value
    assert md == "10.0.0.1:8000,[fd00::1]:8000"
    big = b"x" * (P.CHUNK_BYTES * 2 + 5)
    duplex = P.picked(eps, body=big, buffered=False, header_list=False)
    assert duplex[0].HasField("request_headers") and header(duplex[0], P.DESTINATION) == "10.0.0.1:8000"
    chunks = [r.request_body.response.body_mutation.streamed_response for r in duplex[1:]]
    assert b"".join(c.body for c in chunks) == big
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    (empty,) = P.streamed(b"", True, request=False)
    assert empty.response_body.response.body_mutation.streamed_response.end_of_stream


def test_an_immediate_response_carries_status_headers_and_body():
    r = P.immediate(429, b'{"error": {}}', [("retry-after", "2")], "shed")
    ir = r.immediate_response
    assert ir.status.code == 429 and ir.body == b'{"error": {}}' and ir.details == "shed"
    assert [(h.header.key, h.header.raw_value) for h in ir.headers.set_headers] == [("retry-after", b"2")]


# -------------------------------------------------------------------- streams


@pytest.mark.parametrize("buffered", [False, True])
async def test_a_streamed_request_from_pick_to_end(buffered):
    p = make_picker(buffered)
    s = Stream(p)
    body = chat(stream=True)
    if buffered:
        (ack,) = await s.send(req_headers(), 1)
        assert ack.HasField("request_headers")
        out = await s.send(req_body(body, True), 1)
    else:
        first_msg = req_headers()
        first_msg.protocol_config.request_body_mode = P.FULL_DUPLEX
        first_msg.protocol_config.response_body_mode = P.FULL_DUPLEX
        assert await s.send(first_msg, 0) == []
        assert await s.send(req_body(body[:50], False), 0) == []  # held until the body ends
        out = await s.send(req_body(body[50:], True), 2)
    first = header(out[0], P.DESTINATION).split(",")
    assert len(first) == 2 and set(first) == {"127.0.0.1:9001", "127.0.0.1:9002"}  # the pick and its fallback
    sent = (
        out[0].request_body.response.body_mutation.body
        if buffered
        else out[1].request_body.response.body_mutation.streamed_response.body
    )
    fwd = json.loads(sent)
    assert fwd["stream_options"] == {"include_usage": True}  # asked for, hidden from the client below
    assert header(out[0], "content-length") == str(len(sent))
    picked = p.endpoints.worker(first[0])
    assert counted(p)[picked][0] == 1 and counted(p)[picked][1] > 0
    await s.send(resp_headers(200, upstream=first[0]), 1)
    (role,) = await s.send(resp_body(sse(ROLE)[:-14], False), 1)
    assert counted(p)[picked][1] > 0  # a role chunk is no token: still queued prefill
    (tok,) = await s.send(resp_body(b"data: " + json.dumps(TOKEN).encode() + b"\n\n", False), 1)
    assert counted(p)[picked][1] == 0 and counted(p)[picked][0] == 1  # prefilled, still running
    (end,) = await s.send(resp_body(sse(USAGE), True), 1)
    mutation = end.response_body.response.body_mutation
    if buffered:  # the answer STREAMED (the default): a chunk the picker changed is replaced
        assert tok.response_body.response.body_mutation.WhichOneof("mutation") is None
        got = mutation.body
    else:  # Envoy said full duplex (protocol_config): every byte echoed back
        assert tok.response_body.response.body_mutation.streamed_response.body.startswith(b"data: ")
        assert mutation.streamed_response.end_of_stream
        got = mutation.streamed_response.body
    assert b"usage" not in got and got.endswith(b"data: [DONE]\n\n")
    assert zero(p)
    m = p.router.metrics
    assert (
        m.registry.get_sample_value("radixfleet_cached_tokens_total", {"worker": picked, "model": "m"}) == 64
    )
    await s.close()


async def test_a_stream_broken_mid_answer_releases_its_load():
    p = make_picker()
    s = Stream(p)
    await s.send(req_headers(), 0)
    out = await s.send(req_body(chat(stream=True), True), 2)
    await s.send(resp_headers(200, upstream=header(out[0], P.DESTINATION).split(",")[0]), 1)
    await s.send(resp_body(sse(ROLE)[:-14], False), 1)
    assert not zero(p)
    await s.close()  # Envoy broke the stream: the generator is closed
    assert zero(p) and p.streams == 0
    assert p.router.dataplane.admission.active == 0


async def test_a_stream_broken_before_the_body_ended_holds_nothing():
    p = make_picker()
    s = Stream(p)
    await s.send(req_headers(), 0)
    await s.send(req_body(chat()[:10], False), 0)
    await s.close()
    assert zero(p) and p.router.dataplane.admission.active == 0


async def test_bad_bodies_are_the_routers_own_answers():
    p = make_picker(limits={"max_body_bytes": 1000})
    for raw, status in ((b"not json", 400), (b'{"messages": []}', 400)):
        s = Stream(p)
        await s.send(req_headers(), 0)
        (r,) = await s.send(req_body(raw, True), 1)
        assert r.immediate_response.status.code == status
        err = json.loads(r.immediate_response.body)["error"]
        assert err["type"] == "invalid_request_error", err
        await s.close()
    s = Stream(p)
    await s.send(req_headers(), 0)
    (r,) = await s.send(req_body(b"x" * 1001, False), 1)  # past the limit: refused before its end
    assert r.immediate_response.status.code == 413
    await s.close()
    s = Stream(p)
    (r,) = await s.send(req_headers(path="/admin/workers", method="GET", eos=True), 1)
    assert r.immediate_response.status.code == 404
    await s.close()
    assert zero(p)


async def test_shed_is_429_with_retry_after_and_counts_nothing():
    class Refuse:
        def check(self, *a, **kw):
            return Overloaded("saturated", retry_after_s=3)

    p = make_picker()
    p.router.dataplane.route.use_shedder(Refuse())
    s = Stream(p)
    await s.send(req_headers(), 0)
    (r,) = await s.send(req_body(chat(), True), 1)
    ir = r.immediate_response
    assert ir.status.code == 429
    assert ("retry-after", b"3") in [(h.header.key, h.header.raw_value) for h in ir.headers.set_headers]
    await s.close()
    assert zero(p)
    assert p.router.metrics.registry.get_sample_value("radixfleet_shed_total") == 1


async def test_the_subset_hint_narrows_the_pick_and_an_empty_one_is_503():
    p = make_picker()
    for _ in range(3):
        s = Stream(p)
        await s.send(req_headers(subset=["127.0.0.1:9002"]), 0)
        out = await s.send(req_body(chat(), True), 2)
        assert header(out[0], P.DESTINATION) == "127.0.0.1:9002"  # no fallback outside the hint
        await s.close()
    s = Stream(p)
    await s.send(req_headers(subset=["10.9.9.9:1"]), 0)
    (r,) = await s.send(req_body(chat(), True), 1)
    assert r.immediate_response.status.code == 503
    assert "subset" in json.loads(r.immediate_response.body)["error"]["message"]
    await s.close()
    assert zero(p)


async def test_a_fallback_that_served_takes_the_count_from_the_pick():
    p = make_picker()
    s = Stream(p)
    await s.send(req_headers(), 0)
    out = await s.send(req_body(chat(), True), 2)
    first, second = header(out[0], P.DESTINATION).split(",")
    pw, fw = p.endpoints.worker(first), p.endpoints.worker(second)
    assert counted(p)[pw][0] == 1 and counted(p)[fw][0] == 0
    (r,) = await s.send(resp_headers(200, upstream=second), 1)  # Envoy could not reach the pick
    assert p.router.pool.get(pw).breaker_fails == 1
    # a non-streamed answer whose usage nothing needs ends at its head, its body not sent here
    assert r.mode_override.response_body_mode == P._pm().ProcessingMode.NONE
    assert zero(p)
    reg = p.router.metrics.registry
    answered = {"worker": fw, "model": "m", "outcome": "answered"}
    assert reg.get_sample_value("radixfleet_worker_requests_total", answered) == 1
    failed = {"worker": pw, "model": "m", "outcome": "failed"}
    assert reg.get_sample_value("radixfleet_worker_requests_total", failed) == 1
    await s.close()


async def test_a_non_streamed_answer_is_read_for_its_usage_where_limits_charge_it():
    p = make_picker(
        keys={"tenant": {"default": "acme"}}, tenancy={"tenants": {"acme": {"tokens_per_min": 600000}}}
    )
    s = Stream(p)
    await s.send(req_headers(), 0)
    out = await s.send(req_body(chat(), True), 2)
    (r,) = await s.send(resp_headers(200, upstream=header(out[0], P.DESTINATION).split(",")[0]), 1)
    assert not r.HasField("mode_override")
    assert not zero(p)  # still running until its body, with its usage, has passed
    answer = json.dumps({"choices": [{"text": "hi"}], "usage": USAGE["usage"]}).encode()
    (r,) = await s.send(resp_body(answer, True), 1)
    assert r.response_body.response.body_mutation.WhichOneof("mutation") is None  # passed on as it came
    assert zero(p)
    assert (
        p.router.metrics.registry.get_sample_value(
            "radixfleet_cached_tokens_total",
            {"worker": p.endpoints.worker(header(out[0], P.DESTINATION).split(",")[0]), "model": "m"},
        )
        == 64
    )
    await s.close()


async def test_the_objective_claims_a_class_and_the_fairness_id_names_the_tenant():
    p = make_picker(
        gateway={"objectives": {"chat-critical": "critical"}},
        keys={"tenant": {"source": "header", "header": P.FAIRNESS_ID}},
        tenancy={"tenants": {"acme": {"max_priority": "critical"}}},
    )
    seen = []
    tenancy = p.router.dataplane.tenancy
    admit = tenancy.admit

    def spy(tenant, key, model, headers, *a):
        t = admit(tenant, key, model, headers, *a)
        seen.append((tenant, t.priority))
        return t

    tenancy.admit = spy
    for objective in ("chat-critical", "sheddable", "unknown"):
        s = Stream(p)
        extra = {P.OBJECTIVE.replace("-", "_"): objective, P.FAIRNESS_ID.replace("-", "_"): "acme"}
        await s.send(req_headers(**extra), 0)
        out = await s.send(req_body(chat(), True), 2)
        assert out[0].HasField("request_headers")
        await s.close()
    assert seen == [("acme", "critical"), ("acme", "sheddable"), ("acme", "standard")]
    assert zero(p)


async def test_a_disaggregated_fleet_is_501():
    workers = [
        {"url": "http://127.0.0.1:9001", "id": "p", "model": "m", "role": "prefill"},
        {"url": "http://127.0.0.1:9002", "id": "d", "model": "m", "role": "decode"},
    ]
    router = Router(parse_config({"workers": workers}))
    for w in router.pool:
        router.pool._set_health(w, HealthState.HEALTHY)
    router.pool.started -= 3600
    p = Picker(router, Endpoints(), buffered=False, header_list=True)
    s = Stream(p)
    await s.send(req_headers(), 0)
    (r,) = await s.send(req_body(chat(), True), 1)
    assert r.immediate_response.status.code == 501
    await s.close()
    assert zero(p)


def test_fail_open_needs_what_envoy_needs_to_send_the_request_on_alone():
    from radixfleet.wire.errors import ConfigError

    for gw, why in (
        ({"failure_mode": "fail_open", "body_mode": "full_duplex_streamed"}, "body_mode buffered"),
        (
            {"failure_mode": "fail_open", "body_mode": "buffered", "cluster": "original_dst"},
            "cluster endpoints",
        ),
    ):
        with pytest.raises(ConfigError) as got:
            parse_config({"gateway": gw})
        assert str(got.value).startswith("gateway.failure_mode: fail_open needs " + why), got.value
    assert parse_config(
        {"gateway": {"failure_mode": "fail_open", "body_mode": "buffered"}}
    ).gateway.failure_mode
