"""A router's YAML in front of real vLLM servers and calls to it, for the engine tests."""

from __future__ import annotations

import json
import random
import time

import httpx

WORDS = (
    "cache prefix token router worker engine request model block hash session turn "
    "system user assistant tool answer question document context memory batch queue "
    "prefill decode latency throughput fleet replica load policy index event"
).split()


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


#: a router_yaml router's data port -> its admin listener's (/admin/*, /metrics)
_ADMIN: dict[int, int] = {}


def remember_admin(port: int, admin_port: int) -> None:
    """Notes that the router on data port ``port`` has its admin listener on ``admin_port``
    (``router_yaml`` does it for its routers; the quick-start fixture for its own)."""
    _ADMIN[port] = admin_port


def admin_url(url: str) -> str:
    """The admin listener of the router at ``url`` (its data port's URL), as
    ``remember_admin`` noted it."""
    host, _, port = url.rpartition(":")
    return f"{host}:{_ADMIN[int(port.rstrip('/'))]}"


def router_yaml(
    path, port: int, servers, model_dir, *, policy: str = "prefix_load", events=(True, True), capacity=(0, 0)
) -> None:
    workers = []
    for i, s in enumerate(servers):
        w = {
            "url": s.url,
            "id": f"vllm-{'ab'[i]}",
            "kind": "vllm",
            "tokenizer": str(model_dir),
            # timeout: a CPU vLLM whose engine takes both cores answers /metrics
            # in seconds
            "metrics": {"interval_s": 0.25, "timeout_s": 5.0},
        }
        if events[i]:
            w["events"] = {
                "endpoint": f"tcp://*:{s.events_port}",
                "replay_endpoint": f"tcp://*:{s.replay_port}",
            }
        else:  # the server publishes; this router follows none (approximate mode)
            w["events"] = {"mode": "off"}
        if capacity[i]:
            w["kv_capacity_tokens"] = capacity[i]
        workers.append(w)
    from radixfleet_tools.harness.procs import free_port

    remember_admin(port, free_port())
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": _ADMIN[port]},
        "policy": {"name": policy},
        "health": {"interval_s": 0.5},
        "workers": workers,
        "response_headers": {"worker_id": True},  # the tests and the A/B count per worker
    }  # default limits
    path.write_text(json.dumps(cfg))


def workers(url: str, client: httpx.Client | None = None) -> list[dict]:
    get = client.get if client is not None else httpx.get
    return get(admin_url(url) + "/admin/workers", timeout=5).json()["workers"]


def wait_for(pred, timeout_s: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (httpx.HTTPError, KeyError, StopIteration):
            pass
        time.sleep(0.1)
    extra = ""
    if proc is not None and proc.proc.poll() is not None:
        extra = proc.output()[-3000:]
    raise AssertionError(f"timed out waiting for {what}{extra}")


def post(url: str, path: str, body: dict, *, stream: bool = False) -> tuple[str, dict, list]:
    """Sends one request; returns (worker, usage, content chunks) — usage from the body,
    or for a stream from the usage event the client asked for."""
    if not stream:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.headers["x-radixfleet-worker"], r.json()["usage"], []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage, chunks = None, []
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        wid = r.headers["x-radixfleet-worker"]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                chunks.append(ev)
    assert usage is not None
    return wid, usage, chunks
