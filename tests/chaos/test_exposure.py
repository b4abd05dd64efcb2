"""What a client can cost or learn from a live router process beyond its own request:
8 MiB bodies of a tenant over its rate limit or of a model nobody serves (refused
before they are parsed and keyed, so ``/health`` stays fast while they arrive),
``/metrics`` (the worker addresses and tenant names it shows are behind the metrics
token once one is set), the prefetch answer (it tells a client without an identity
nothing about what others sent), the prefetch budget (per tenant: one tenant's
flood does not refuse another's) and a full disk under the traffic log (kept files
are never rotated out for empty ones).

Each probe is bounded in time and count, on loopback; nothing >= 500 is answered
and nothing is logged as a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port
from radixfleet_tools.harness.router_process import RouterProcess

pytestmark = pytest.mark.integration

#: just under limits.max_body_bytes' default (8 MiB): a chat body of many short
#: messages, the costliest kind to parse and key
BIG_MESSAGES = (8 * 2**20 - 4096) // 57


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    argv = ["python3", "-m", "radixfleet_tools.bench.proxy", "upstream", "--port", str(port), "--chunks", "2"]
    with Proc(argv, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def _big_body(model: str) -> bytes:
    msgs = [{"role": "user", "content": f"message {i:08d} of many"} for i in range(BIG_MESSAGES)]
    return json.dumps({"model": model, "messages": msgs}).encode()


async def _post_raw(port: int, path: str, headers: dict[str, str], body: bytes) -> int:
    """POSTs ``body`` on a fresh connection; the status, or 0 when the router closed
    the connection before answering. The body is sent while the answer is read: a
    router that answers from the head may close before the body is all sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"

    async def send() -> None:
        try:
            writer.write(head.encode())
            for off in range(0, len(body), 1 << 20):
                writer.write(body[off : off + (1 << 20)])
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # answered and closed while the body was still going: expected

    sender = asyncio.create_task(send())
    try:
        line = await asyncio.wait_for(reader.readline(), 30)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 else 0


async def _health_while_flooded(
    r: RouterProcess, body: bytes, headers: dict[str, str], *, senders: int = 4, seconds: float = 4.0
) -> tuple[list[float], dict[int, int]]:
    """``/health`` latencies (s) while ``senders`` clients post ``body`` back to back
    for ``seconds`` (at most 40 bodies in all), and the bodies' statuses."""
    statuses: dict[int, int] = {}
    lat: list[float] = []
    stop = time.monotonic() + seconds
    budget = [40]

    async def flood() -> None:
        while time.monotonic() < stop and budget[0] > 0:
            budget[0] -= 1
            st = await _post_raw(r.port, "/v1/chat/completions", headers, body)
            statuses[st] = statuses.get(st, 0) + 1

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            await c.get(f"{r.base}/health")
            while time.monotonic() < stop:
                t = time.perf_counter()
                assert (await c.get(f"{r.base}/health")).status_code == 200
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

    await asyncio.gather(probe(), *(flood() for _ in range(senders)))
    return lat, statuses


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _capped_config(upstream: str) -> str:
    return (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {upstream}, id: up}}]\n"
        "keys: {tenant: {source: header, header: x-tenant-id}}\n"
        "tenancy:\n"
        "  tenants:\n"
        "    capped: {requests_per_s: 0.01, request_burst: 1}\n"
        "warmup: {enabled: false}\nreload: {watch: false}\n"
    )


def test_a_tenant_over_its_rate_limit_is_refused_from_the_head(upstream):
    with RouterProcess(config=_capped_config(upstream)) as r:
        h = {"x-tenant-id": "capped"}
        small = {"model": "tiny", "prompt": "p", "max_tokens": 1}
        assert httpx.post(f"{r.base}/v1/completions", json=small, headers=h, timeout=10).status_code == 200

        async def head_only() -> tuple[bytes, float]:
            """The head of an 8 MiB request, no body byte: the answer must come anyway."""
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            t = time.perf_counter()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-tenant-id: capped\r\n"
                b"Content-Type: application/json\r\nContent-Length: 8388000\r\n\r\n"
            )
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            except asyncio.TimeoutError:
                head = b""
            writer.close()
            return head, time.perf_counter() - t

        head, took = asyncio.run(head_only())
        assert head.startswith(b"HTTP/1.1 429"), f"no 429 from the head within 5 s: {head!r}"
        assert b"x-ratelimit-limit-requests: 1" in head.lower() and b"retry-after" in head.lower(), head
        assert took < 2.0, took
        lat, statuses = asyncio.run(_health_while_flooded(r, _big_body("tiny"), h))
        assert set(statuses) <= {429, 0} and statuses.get(429, 0) >= 4, statuses
        print(
            f"health while a capped tenant posts 8 MiB bodies: p50 {_q(lat, 0.5) * 1e3:.1f} ms, "
            f"p99 {_q(lat, 0.99) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms, {statuses}"
        )
        assert max(lat) < 0.5, f"/health waited {max(lat):.2f}s behind refused bodies"
    r.assert_no_tracebacks()


def test_bodies_for_a_model_nobody_serves_are_refused_unparsed(upstream):
    config = (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {upstream}, id: up}}]\n"
        "warmup: {enabled: false}\nreload: {watch: false}\n"
    )
    with RouterProcess(config=config) as r:
        small = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        deadline = time.monotonic() + 30  # 503 + Retry-After in the router's first seconds
        while True:
            ans = httpx.post(f"{r.base}/v1/chat/completions", json=small, timeout=10)
            if ans.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ans.status_code == 404 and "'tiny'" in ans.json()["error"]["message"], ans.text
        lat, statuses = asyncio.run(_health_while_flooded(r, _big_body("nope"), {}))
        assert set(statuses) == {404}, statuses
        print(
            f"health while 8 MiB bodies name an unserved model: p50 {_q(lat, 0.5) * 1e3:.1f} ms, "
            f"p99 {_q(lat, 0.99) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms, {statuses}"
        )
        assert max(lat) < 0.5, f"/health waited {max(lat):.2f}s behind refused bodies"
    r.assert_no_tracebacks()


def test_metrics_need_the_metrics_token_once_one_is_set(upstream):
    env = {"RADIXFLEET_METRICS_TOKEN": "m-token", "RADIXFLEET_ADMIN_TOKEN": "a-token"}
    with RouterProcess(argv=["--worker", upstream], env=env) as r:
        url = f"{r.admin}/metrics"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "m-token"}):
            ans = httpx.get(url, headers=headers, timeout=10)
            assert ans.status_code == 401, (headers, ans.status_code)
            assert ans.json()["error"]["code"] and "radixfleet_" not in ans.text, ans.text
        for token in ("m-token", "a-token"):  # the scraper's token, or the admin's
            ans = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
            assert ans.status_code == 200 and "radixfleet_worker_healthy" in ans.text, ans.status_code
    r.assert_no_tracebacks()


def _prefetch_config(upstream: str, extra: str = "") -> str:
    return (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {upstream}, id: up, kind: openai, prefill_tokens_per_s: 2000}}]\n"
        "warmup: {enabled: false}\nreload: {watch: false}\n" + extra
    )


def _prefetch(r: RouterProcess, text: str, headers: dict | None = None) -> httpx.Response:
    """A prefetch of ``text`` and a few hundred bytes more (several routing blocks)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": text + " and more" * 60}]}
    return httpx.post(f"{r.base}/v1/prefetch", json=body, headers=headers or {}, timeout=10)


def test_a_prefetch_answer_tells_a_client_nothing_of_what_another_sent(upstream):
    with RouterProcess(config=_prefetch_config(upstream)) as r:
        secret = "the merger closes on friday " + os.urandom(8).hex()
        first = _prefetch(r, secret)  # one client's prefetch (no tenants configured)
        assert first.status_code == 202, first.text
        # another client asks about the same text, and about one nobody sent
        probe = _prefetch(r, secret)
        control = _prefetch(r, "nobody sent this " + os.urandom(8).hex())
        assert probe.status_code == control.status_code == 202, (probe.text, control.text)
        assert probe.json() == control.json() == first.json(), (probe.json(), control.json())
        assert "deduplicated" not in probe.json()
        page = httpx.get(f"{r.admin}/metrics", timeout=10).text  # loopback: no token needed
        assert 'radixfleet_prefetch_total{outcome="deduplicated"} 1.0' in page  # it was
    r.assert_no_tracebacks()


def test_one_tenants_prefetch_flood_does_not_spend_anothers_budget(upstream):
    extra = (
        "keys: {tenant: {source: api_key, api_keys: [{tenant: acme, key: k-acme}, "
        "{tenant: beta, key: k-beta}]}}\n"
        "prefetch: {share: 0.05, burst_s: 4.0}\n"  # 100 tokens/s, 400 at once
    )
    with RouterProcess(config=_prefetch_config(upstream, extra)) as r:
        acme, beta = {"Authorization": "Bearer k-acme"}, {"Authorization": "Bearer k-beta"}
        flood = [_prefetch(r, f"acme document {i} " + os.urandom(8).hex(), acme) for i in range(60)]
        statuses = [x.status_code for x in flood]
        assert 202 in statuses and statuses[-1] == 429, statuses
        assert flood[-1].json()["error"]["code"] == "overloaded"
        ans = _prefetch(r, "beta's first document " + os.urandom(8).hex(), beta)
        assert ans.status_code == 202, ans.text  # its own part, untouched by acme's flood
        assert _prefetch(r, "acme again " + os.urandom(8).hex(), acme).status_code == 429
    r.assert_no_tracebacks()


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=16k tmpfs /mnt"],
        capture_output=True,
        timeout=10,
    )
    return probe.returncode == 0


def test_a_full_disk_stops_the_traffic_log_and_keeps_its_files(upstream, tmp_path):
    if not _can_mount_tmpfs():
        pytest.skip("needs unshare and a tmpfs mount in a private mount namespace")
    d = tmp_path / "traffic"
    d.mkdir()
    # the router in a mount namespace of its own, its log directory a 32 KiB tmpfs
    mount = 'mount -t tmpfs -o size=32k tmpfs "$0" && exec "$@"'
    config = (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {upstream}, id: up}}]\n"
        f"traffic_log: {{enabled: true, dir: {d}, max_file_bytes: 4096, max_files: 16, "
        "flush_interval_s: 0.05}\n"
        "warmup: {enabled: false}\nreload: {watch: false}\n"
    )
    with RouterProcess(config=config, launcher=["unshare", "-rm", "sh", "-c", mount, str(d)]) as r:
        seen = f"/proc/{r.pid}/root{d}"  # the directory as the router sees it

        def files() -> dict[str, int]:
            return {n: os.path.getsize(os.path.join(seen, n)) for n in sorted(os.listdir(seen))}

        async def send(n: int) -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                sem = asyncio.Semaphore(8)

                async def one(i: int) -> None:
                    body = {"model": "tiny", "prompt": f"request {i} " + "p" * 600, "max_tokens": 1}
                    async with sem:
                        assert (await c.post(f"{r.base}/v1/completions", json=body)).status_code == 200

                await asyncio.gather(*(one(i) for i in range(n)))

        first = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the disk is full (the log stops)
            asyncio.run(send(40))
            first = first or next(iter(files()), None)
            if "radixfleet_traffic_log_writing 0.0" in httpx.get(f"{r.admin}/metrics", timeout=10).text:
                break
        else:
            raise AssertionError(f"the log never stopped: {files()}")
        kept = files()
        for _ in range(3):  # go on logging for a second and a half (30 flush rounds)
            asyncio.run(send(40))
            time.sleep(0.5)
        now = files()
        assert first in now, (first, now)  # nothing rotated out
        assert all(size > 0 for size in now.values()), now  # no empty file
        assert set(now) == set(kept), (kept, now)
    out = r.output()
    assert out.count("stopped writing") == 1, out[-3000:]
    r.assert_no_tracebacks()
