"""radixfleet as the endpoint picker of a real Envoy (``radixfleet gateway``), in front
of ``radixfleet agent`` processes on loopback: the bytes through Envoy, the decisions
and the load accounting in the router (tests/router/gateway_fleet.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from tests.router.gateway_fleet import GatewayFleet

pytestmark = pytest.mark.integration

PROMPT = "You are a careful assistant of the acme tenant; answer briefly and cite sources. " * 8


def chat(content: str, stream: bool, max_tokens: int = 8, **kw) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        **kw,
    }


def sse_events(text: str) -> list[str]:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


@pytest.mark.parametrize("body_mode", ["full_duplex_streamed", "buffered"])
async def test_streamed_and_not_through_envoy_and_the_load_returns_to_zero(body_mode):
    async with GatewayFleet(gateway={"body_mode": body_mode}) as f, f.client() as c:
        for i in range(4):
            r = await c.post("/v1/chat/completions", json=chat(f"question {i}", stream=False))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"]
            assert body["usage"]["prompt_tokens"] > 0
            r = await c.post("/v1/chat/completions", json=chat(f"question {i}", stream=True))
            assert r.status_code == 200, r.text
            events = sse_events(r.text)
            assert events[-1] == "[DONE]", events
            # the usage event the picker asked for (the client did not) is hidden
            assert not any('"usage": {' in e or '"usage":{' in e for e in events[:-1]), events
        await f.settled()
        m = f.router.metrics.render().decode()
        # every answer counted as the standalone router counts it
        assert "radixfleet_requests_total{reason=" in m or "radixfleet_requests_total" in m
        answered = sum(
            float(line.rsplit(" ", 1)[1])
            for line in m.splitlines()
            if line.startswith("radixfleet_worker_requests_total{") and 'outcome="answered"' in line
        )
        assert answered == 8, m
        # the stream asked for usage (hidden from the client): the engine link learned it
        assert any(
            line.startswith("radixfleet_cached_tokens_total{") and float(line.rsplit(" ", 1)[1]) > 0
            for line in m.splitlines()
        ), "cached tokens of the repeated prompt were never seen"


async def test_bad_bodies_get_the_standalone_routers_answers():
    async with GatewayFleet(agents=1, raw={"limits": {"max_body_bytes": 4096}}) as f, f.client() as c:
        direct = httpx.AsyncClient(base_url=f.router_url, timeout=10)  # the router's own data plane
        try:
            for content in (b"not json", b'{"messages": [{"role": "user", "content": "hi"}]}'):
                got = await c.post("/v1/chat/completions", content=content)
                want = await direct.post("/v1/chat/completions", content=content)
                assert got.status_code == want.status_code == 400, (got.text, want.text)
                assert got.json() == want.json()
            big = json.dumps(chat("x" * 8000, stream=False)).encode()
            got = await c.post("/v1/chat/completions", content=big)
            assert got.status_code == 413, got.text
            assert got.json()["error"]["code"] == "payload_too_large"
            got = await c.get("/nothing/here")
            assert got.status_code == 404 and got.json()["error"]["type"] == "not_found_error"
            models = await c.get("/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
        finally:
            await direct.aclose()
        await f.settled()


async def test_shed_requests_get_429_with_retry_after():
    from radixfleet.wire.errors import Overloaded

    class Refuse:
        def check(self, workers, model, adapter, uncached, now, scale=1.0, *, prefetch=False):
            return Overloaded("every worker is saturated", retry_after_s=2)

    async with GatewayFleet(agents=1) as f, f.client() as c:
        f.router.dataplane.route.use_shedder(Refuse())
        r = await c.post("/v1/chat/completions", json=chat("shed me", stream=True))
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error"
        await f.settled()
        assert "radixfleet_shed_total 1.0" in f.router.metrics.render().decode()


async def test_the_subset_hint_restricts_the_pick_and_an_empty_one_is_503():
    only: list[str] = []

    def with_subset(doc: dict) -> None:
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"].insert(
            1,
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": list(only)},
                        }
                    ],
                },
            },
        )

    fleet = GatewayFleet(agents=2, edit=with_subset)
    only.append(fleet.endpoint(1))  # the hint allows the second agent alone
    async with fleet as f, f.client() as c:
        for i in range(6):
            r = await c.post("/v1/chat/completions", json=chat(f"subset {i}", stream=False))
            assert r.status_code == 200, r.text
        answered = {
            line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in f.router.metrics.render().decode().splitlines()
            if line.startswith("radixfleet_worker_requests_total{") and 'outcome="answered"' in line
        }
        assert answered == {"a1": 6.0}, answered
        await f.settled()

    only[:] = ["127.0.0.1:1"]  # names no worker
    async with GatewayFleet(agents=1, edit=with_subset) as f, f.client() as c:
        r = await c.post("/v1/chat/completions", json=chat("nowhere", stream=False))
        assert r.status_code == 503, r.text
        assert "subset" in r.json()["error"]["message"]
        assert "retry-after" in r.headers
        await f.settled()


async def test_a_picked_endpoint_that_died_is_retried_on_the_next_and_runs_once():
    # slow health checks: the router still thinks the dead agent is there
    slow = {"interval_s": 30.0, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}
    async with (
        GatewayFleet(agents=2, raw={"policy": {"name": "round_robin"}}, health=slow) as f,
        f.client() as c,
    ):
        f.agents[0].kill()
        for i in range(4):
            r = await c.post("/v1/chat/completions", json=chat(f"after the crash {i}", stream=i % 2 == 0))
            assert r.status_code == 200, (r.text, f.envoy_log())
        await f.settled()
        m = f.router.metrics.render().decode()
        lines = [ln for ln in m.splitlines() if ln.startswith("radixfleet_worker_requests_total{")]
        served = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'worker="a1"' in ln and "answered" in ln)
        failed = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'worker="a0"' in ln and "failed" in ln)
        assert served == 4, lines  # each request ran once, on the live agent
        assert failed >= 1, lines  # the pick Envoy could not reach was counted as failed
        assert 'radixfleet_retries_total{cause="connect"}' in m


@pytest.mark.parametrize("failure_mode", ["fail_closed", "fail_open"])
async def test_the_picker_gone(failure_mode):
    # fail-open needs Envoy to keep the body (buffered): in full duplex the picker has it
    mode = "buffered" if failure_mode == "fail_open" else "full_duplex_streamed"
    gateway = {"failure_mode": failure_mode, "body_mode": mode}
    async with GatewayFleet(agents=1, gateway=gateway) as f, f.client() as c:
        r = await c.post("/v1/chat/completions", json=chat("before", stream=False))
        assert r.status_code == 200
        await f.gw.grpc.aclose(grace_s=0.5)  # the picker's port closes: Envoy cannot reach it
        await asyncio.sleep(0.3)
        r = await c.post("/v1/chat/completions", json=chat("after", stream=False))
        if failure_mode == "fail_closed":
            assert r.status_code == 503, r.text
        else:  # Envoy routes it itself, over the workers it was told of
            assert r.status_code == 200, (r.text, f.envoy_log())
            assert r.json()["choices"][0]["message"]["content"]


async def test_a_stream_broken_by_the_client_releases_its_load():
    async with GatewayFleet(agents=1) as f:
        async with f.client() as c:
            async with c.stream(
                "POST", "/v1/chat/completions", json=chat("long", stream=True, max_tokens=4000)
            ) as r:
                assert r.status_code == 200
                async for _chunk in r.aiter_bytes():
                    break  # the first bytes, then the client hangs up
        counted = f.counted()
        await f.settled()
        assert not f.gw.picker.open
        assert f.gw.picker.streams == 0
        assert counted is not None
        m = f.router.metrics.render().decode()
        assert any(
            ln.startswith("radixfleet_worker_requests_total{") and 'outcome="gone"' in ln
            for ln in m.splitlines()
        ), m


async def _hit_rate(mode: str) -> float:
    """Prompt tokens served from cache over prompt tokens, on a short multi-turn run."""
    async with GatewayFleet(agents=2, mode=mode) as f, f.client() as c:
        prompt = cached = 0
        history = {s: [{"role": "system", "content": f"Session {s}: " + PROMPT}] for s in range(4)}
        for turn in range(4):
            for s, msgs in history.items():
                msgs.append({"role": "user", "content": f"turn {turn} of session {s}: tell me more"})
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": msgs, "max_tokens": 8},
                    headers={"x-session-id": f"s{s}"},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                u = body["usage"]
                prompt += u["prompt_tokens"]
                cached += u["prompt_tokens_details"]["cached_tokens"]
        await f.settled()
        return cached / prompt


async def test_hit_rate_on_a_multi_turn_run_matches_the_standalone_router():
    via_envoy = await _hit_rate("gateway")
    standalone = await _hit_rate("router")
    assert via_envoy > 0.4, via_envoy
    assert abs(via_envoy - standalone) <= 0.05, (via_envoy, standalone)


# ---------------------------------------------------------------- the command


def test_print_bootstrap_is_a_bootstrap_envoy_accepts(tmp_path):
    from radixfleet.config import parse_config
    from radixfleet.gateway import bootstrap as bs
    from radixfleet.gateway.envoy import envoy_binary, validate

    state = tmp_path / "state"
    out = subprocess.run(
        radixfleet_argv(
            "gateway",
            "--worker",
            "http://127.0.0.1:9",
            "--port",
            "18081",
            "--print-bootstrap",
            "--state-dir",
            str(state),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 18081
    assert not state.exists()  # printing writes nothing
    path = tmp_path / "envoy.json"
    path.write_text(out.stdout)
    state.mkdir()
    bs.write_endpoints(str(state / bs.ENDPOINTS_FILE), ["127.0.0.1:9"])  # what --no-envoy writes there
    validate(envoy_binary(parse_config({})), str(path))  # raises if Envoy refuses it


def test_a_bootstrap_envoy_refuses_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "envoy.yaml"
    bad.write_text("static_resources:\n  listeners:\n  - name: x\n    adress: {}\n")
    out = subprocess.run(
        radixfleet_argv(
            "gateway",
            "--worker",
            "http://127.0.0.1:9",
            "--bootstrap",
            str(bad),
            "--state-dir",
            str(tmp_path / "s"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    err = out.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("radixfleet gateway: error: bootstrap: Envoy refused"), err
    assert "adress" in err, err


def test_the_command_starts_envoy_and_the_picker_and_stops_both(tmp_path):
    aport, gport, rport = free_port(), free_port(), free_port()
    with Proc(
        radixfleet_argv("agent", "--port", str(aport), "--served-model-name", "m", "--kv-tokens", "20000"),
        ready_url=f"http://127.0.0.1:{aport}/health",
    ):
        gw = Proc(
            radixfleet_argv(
                "gateway",
                "--worker",
                f"http://127.0.0.1:{aport}",
                "--port",
                str(gport),
                "--router-port",
                str(rport),
                "--picker-port",
                str(free_port()),
                "--state-dir",
                str(tmp_path),
            ),
            timeout_s=60,
        )
        with gw:
            deadline = time.monotonic() + 60
            r = None
            while time.monotonic() < deadline:
                try:
                    r = httpx.post(
                        f"http://127.0.0.1:{gport}/v1/completions",
                        json={"model": "m", "prompt": "hello there", "max_tokens": 4},
                        timeout=5,
                    )
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            assert r is not None and r.status_code == 200, (r and r.text, gw.output())
            envoy_pid = _envoy_pid(str(tmp_path / "envoy.json"))
            assert envoy_pid is not None
            out = gw.stop()
        assert gw.proc.returncode == 0, out
        assert not _alive(envoy_pid), "Envoy outlived the gateway"
        assert "radixfleet gateway: Envoy on" in out


def _envoy_pid(boot: str) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if boot.encode() in cmd and any(c.endswith(b"envoy") for c in cmd[:1]):
            return int(pid)
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


async def test_grpc_health_answers_liveness_readiness_and_the_service():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with GatewayFleet(agents=1) as f:
        await f.gw.sync()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{f.gw.grpc.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
                got = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert got.status == health_pb2.HealthCheckResponse.SERVING, service
            f.agents[0].kill()  # no routable worker: not ready, still alive
            await f.until(lambda: not f.routable(), 10.0, "the agent unroutable")
            await f.gw.sync()
            got = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
            got = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING
