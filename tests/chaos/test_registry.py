"""Chaos probes of how workers join and are trusted, against a live router process:
registrations that try to take a configured worker's id, floods of fake workers,
huge event batches, worker URLs that point where they must not, and agents that
hang up mid-request. Each asserts the router's answer, that legitimate traffic is
served throughout, that its memory and descriptors settle and that it logged no
traceback."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from protocol.events import EventBatch, Snapshot
from tests.chaos.harness import RouterProcess
from tests.procs import radixfleet_argv
from tests.router.serve import upstream_proc

pytestmark = pytest.mark.integration

REGISTER = "/internal/v1/register"
EVENTS = "/internal/v1/events"


@pytest.fixture(scope="module")
def upstream():
    proc, url = upstream_proc("up")
    with proc:
        yield url


def served(base: str, n: int) -> list[int]:
    """Status codes of ``n`` ordinary completions."""
    with httpx.Client(timeout=10) as c:
        return [
            c.post(
                base + "/v1/completions", json={"model": "m", "prompt": f"hello {i}", "max_tokens": 2}
            ).status_code
            for i in range(n)
        ]


def wait_routable(base: str, n: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(httpx.get(base + "/readiness", timeout=2).json()["routable"]) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{n} routable workers not reached")


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def test_a_configured_workers_id_cannot_be_taken(upstream):
    with RouterProcess(argv=["--worker", f"url={upstream},id=w0"]) as r:
        wait_routable(r.base, 1)
        base = r.resources()
        with httpx.Client(timeout=5) as c:
            reg = c.post(
                r.base + REGISTER, json={"worker_id": "w0", "url": "http://127.0.0.1:19998", "epoch": "x"}
            )
            assert reg.status_code == 409 and reg.json()["status"] == "worker_id_taken", reg.text
            batch = EventBatch("w0", "http://127.0.0.1:19998", "x", 0, [Snapshot([(7, None)])])
            ev = c.post(r.base + EVENTS, json=batch.to_json())
            assert ev.status_code == 404, ev.text
            workers = c.get(r.base + "/admin/workers").json()
        listed = workers["workers"] if isinstance(workers, dict) else workers
        assert [(w["id"], w["url"]) for w in listed] == [("w0", upstream)]
        assert served(r.base, 5) == [200] * 5
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_a_flood_of_fake_registrations_is_bounded_and_never_routed_to(upstream):
    """2,000 registrations of workers that do not exist: past the burst they get 429
    with Retry-After; the ones admitted are probed before they are routable, so
    every legitimate request is served meanwhile and after."""
    with RouterProcess(argv=["--worker", f"url={upstream},id=real"]) as r:
        wait_routable(r.base, 1)
        base = r.resources()
        codes: list[int] = []
        retry_after: set[str] = set()

        def register(i: int) -> None:
            with httpx.Client(timeout=10) as c:
                for j in range(i, 2000, 8):
                    resp = c.post(
                        r.base + REGISTER,
                        json={
                            "worker_id": f"fake{j}",
                            "url": f"http://127.0.0.1:{20000 + j}",
                            "epoch": "e",
                            "models": ["m"],
                        },
                    )
                    codes.append(resp.status_code)
                    if resp.status_code == 429:
                        retry_after.add(resp.headers.get("Retry-After", ""))

        flood = [threading.Thread(target=register, args=(i,)) for i in range(8)]
        started = time.monotonic()
        for t in flood:
            t.start()
        during = served(r.base, 20)
        for t in flood:
            t.join(120)
        took = time.monotonic() - started
        after = served(r.base, 20)
        assert during == [200] * 20 and after == [200] * 20, (during, after)
        assert len(codes) == 2000 and set(codes) == {200, 429}, sorted(set(codes))
        # the default burst (200), plus what the default rate (10/s) refilled meanwhile
        assert codes.count(200) <= 200 + 10 * took + 1, (codes.count(200), took)
        assert "" not in retry_after
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_huge_event_batches_do_not_hold_the_loop(upstream):
    """300,000-block snapshots pushed in a loop: applied in slices (and parsed off
    the loop), so the router's other answers stay prompt."""
    with RouterProcess(argv=["--worker", f"url={upstream},id=big"]) as r:
        wait_routable(r.base, 1)
        base = r.resources()
        body = json.dumps(
            EventBatch(
                "big", upstream, "e", 0, [Snapshot([(i + 1, i if i else None) for i in range(300_000)])]
            ).to_json()
        ).encode()
        with httpx.Client(timeout=60) as c:
            assert (
                c.post(
                    r.base + REGISTER, json={"worker_id": "big", "url": upstream, "epoch": "e"}
                ).status_code
                == 200
            )
        stop = threading.Event()
        posting = threading.Event()
        answered = [0, 0.0]  # /health answers that began and ended within a POST; worst

        def probe() -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    inside = posting.is_set()
                    t0 = time.perf_counter()
                    c.get(r.base + "/health")
                    if inside and posting.is_set():
                        answered[0] += 1
                    answered[1] = max(answered[1], time.perf_counter() - t0)
                    time.sleep(0.005)

        prober = threading.Thread(target=probe)
        prober.start()
        took = []
        try:
            with httpx.Client(timeout=120) as c:
                for _ in range(3):
                    t0 = time.perf_counter()
                    posting.set()
                    resp = c.post(r.base + EVENTS, content=body, headers={"Content-Type": "application/json"})
                    posting.clear()
                    took.append(time.perf_counter() - t0)
                    assert resp.status_code == 200, resp.text
        finally:
            stop.set()
            prober.join(60)
        # Held all along, the loop answers nothing while a batch is parsed and applied
        # (only during its upload); in slices it answers between them, every few ms of
        # CPU. Counted, not timed: on a shared machine any one answer may wait.
        assert answered[0] >= 10 * len(took), (
            f"{answered[0]} /health answers during {len(took)} batches taking {took} s "
            f"(slowest answer {answered[1]:.2f} s)"
        )
        assert served(r.base, 3) == [200] * 3
        r.assert_settles(base, rss_slack=256 << 20)
    r.assert_no_tracebacks()


@pytest.mark.parametrize(
    "url, answer",
    [
        ("http://169.254.169.254", 400),
        ("http://user:pass@127.0.0.1:9", 400),
        ("http://[fe80::1]:80", 400),
        ("http://0.0.0.0:9001", 400),
    ],
)
def test_worker_urls_that_point_where_they_must_not_are_refused(upstream, url, answer):
    with RouterProcess(argv=["--worker", f"url={upstream},id=real"]) as r:
        with httpx.Client(timeout=5) as c:
            a = c.post(r.base + "/admin/workers", json={"url": url})
            assert a.status_code == answer and "worker.url: " in a.json()["error"]["message"], a.text
            g = c.post(r.base + REGISTER, json={"worker_id": "x", "url": url, "epoch": "e"})
            assert g.status_code == answer and g.json()["error"]["param"] == "url", g.text
    r.assert_no_tracebacks()


def test_numeric_ipv4_forms_are_one_worker(upstream):
    """``0x7f.1`` and ``2130706433`` are 127.0.0.1: the worker already listed."""
    port = upstream.rsplit(":", 1)[1]
    with RouterProcess(argv=["--worker", f"url={upstream},id=real"]) as r:
        with httpx.Client(timeout=5) as c:
            for host in ("0x7f.1", "2130706433", "0177.0.0.1"):
                a = c.post(r.base + "/admin/workers", json={"url": f"http://{host}:{port}"})
                assert a.status_code == 409, a.text
                assert f"'http://127.0.0.1:{port}' already exists (id 'real')" in a.text
            assert len(c.get(r.base + "/admin/workers").json()["workers"]) == 1
    r.assert_no_tracebacks()


def test_a_link_local_worker_in_the_file_is_a_config_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("workers:\n  - {url: http://127.0.0.1:9}\n  - {url: 'http://169.254.169.254'}\n")
    out = subprocess.run(
        radixfleet_argv("check-config", str(path)), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "workers[1].url" in out.stderr and "link-local" in out.stderr


def test_agents_hanging_up_mid_request_are_one_counted_line_each(upstream):
    with RouterProcess(argv=["--worker", f"url={upstream},id=w0"]) as r:
        base = r.resources()
        head = (
            f"POST {EVENTS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100000\r\n\r\n"
        ).encode()

        def hang_up(_: int) -> None:
            with socket.create_connection(("127.0.0.1", r.port), timeout=5) as s:
                s.sendall(head + b'{"worker_id": "w0", "events": [' + b"1," * 2000)
                time.sleep(0.05)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(hang_up, range(40)))
        deadline = time.monotonic() + 10
        while metric(r.base, "radixfleet_peer_hangups_total") < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(r.base, "radixfleet_peer_hangups_total") == 40
        assert served(r.base, 3) == [200] * 3
        r.assert_settles(base)
        out = r.output()
    assert out.count("hung up before its request was read") == 40, out[-3000:]
    r.assert_no_tracebacks()
