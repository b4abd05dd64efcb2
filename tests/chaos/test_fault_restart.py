"""A router that crashes and restarts is routable again as soon as it listens.

Real processes on loopback: agent A (model fz-a) is listed in the router's YAML and
does not register; agent B (model fz-b) only registers itself (``--router``). The
router is killed (SIGKILL) while clients keep sending requests for both models, and
restarted on the same port. From the first connection the new process accepts:

- every request for fz-a is served (the YAML worker was health-checked before the
  socket opened);
- requests for fz-b are served within 1 s (B re-registers on its next event batch);
  until then they get 503 with ``Retry-After``;
- no client sees a 503 without ``Retry-After``, nor any other 5xx or a 404.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import free_port

pytestmark = pytest.mark.integration


def _spawn(argv: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "RADIXFLEET_AGENT_TOKEN": "fault-token", "RADIXFLEET_TENANT_SALT": "fault-salt"},
    )


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def _hammer(base: str, model: str, until: float, out: list) -> None:
    """Back-to-back requests (a fresh connection each) until ``until``; records
    (time, status or None when refused, Retry-After)."""
    body = {"model": model, "prompt": "hello " * 20, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        while time.monotonic() < until:
            t = time.monotonic()
            try:
                r = await c.post(base + "/v1/completions", json=body)
                out.append((t, r.status_code, r.headers.get("retry-after")))
            except httpx.TransportError:
                out.append((t, None, None))
            await asyncio.sleep(0.005)


def test_restarted_router_is_routable_as_soon_as_it_listens(tmp_path):
    port, pa, pb = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        json.dumps(
            {
                "listen": {"port": port},
                "workers": [{"url": f"http://127.0.0.1:{pa}", "id": "a"}],
                "health": {"interval_s": 1.0, "timeout_s": 0.5},
                "reload": {"watch": False},
            }
        )
    )
    logs = open(tmp_path / "procs.log", "wb")
    agent = [sys.executable, "-m", "radixfleet.cli", "agent", "--kv-tokens", "50000"]
    router_argv = [sys.executable, "-m", "radixfleet.cli", "router", "--config", str(cfg)]
    procs = [
        _spawn([*agent, "--port", str(pa), "--served-model-name", "fz-a"], logs),
        _spawn(
            [*agent, "--port", str(pb), "--served-model-name", "fz-b", "--worker-id", "b", "--router", base],
            logs,
        ),
    ]
    router = _spawn(router_argv, logs)
    try:
        _wait(
            lambda: len(httpx.get(base + "/readiness", timeout=1).json()["routable"]) == 2,
            60,
            "both agents routable",
        )
        os.killpg(router.pid, signal.SIGKILL)  # a crash: nothing is flushed, nobody told
        router.wait(5)
        log: dict[str, list] = {"fz-a": [], "fz-b": []}

        async def scenario():
            end = time.monotonic() + 60
            clients = [asyncio.create_task(_hammer(base, m, end, log[m])) for m in log]
            await asyncio.sleep(0.3)  # refused connections while it is down
            nonlocal router
            router = _spawn(router_argv, logs)
            # run until fz-b has been served for a second (bounded by `end`)
            while time.monotonic() < end:
                ok_b = [t for t, s, _ in log["fz-b"] if s == 200]
                if ok_b and time.monotonic() - ok_b[0] > 1.0:
                    break
                await asyncio.sleep(0.05)
            for c in clients:
                c.cancel()
            await asyncio.gather(*clients, return_exceptions=True)

        asyncio.run(scenario())
    finally:
        for p in (router, *procs):
            _stop(p)
        logs.close()
    answered = sorted((t, s, ra, m) for m in log for t, s, ra in log[m] if s is not None)
    assert answered, "the restarted router never answered"
    t_listen = answered[0][0]
    bad = [(s, ra, m) for _, s, ra, m in answered if not (s == 200 or (s == 503 and ra and int(ra) >= 1))]
    assert not bad, bad[:10]  # no 503 without Retry-After, no other error
    a = [s for t, s, _, m in answered if m == "fz-a"]
    assert a and set(a) == {200}, a[:20]  # the YAML worker: served from the first answer
    first_b = min(t for t, s, _, m in answered if m == "fz-b" and s == 200)
    print(
        f"\nrestart: fz-a served from the first answer ({len(a)} requests); fz-b "
        f"{first_b - t_listen:.2f}s after the router listened"
    )
    assert first_b - t_listen <= 1.0
