"""Chaos probes of how workers join and are trusted, against a live router process:
registrations that try to take a configured worker's id, floods of fake workers,
huge event batches, worker URLs that point where they must not (the router itself
included), a live worker's registration flapped through new epochs, absurd load
reports, and agents that hang up mid-request. Each asserts the router's answer,
that legitimate traffic is served throughout, that its memory and descriptors
settle and that it logged no traceback."""

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

from radixfleet.wire.events import EventBatch, Snapshot
from radixfleet_tools.harness.procs import radixfleet_argv
from radixfleet_tools.harness.router_process import RouterProcess
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


def metric(base: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s series (those whose labels contain ``labels``, if given)."""
    text = httpx.get(base + "/metrics", timeout=5).text
    return sum(
        float(m.group(2))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
        if labels in (m.group(1) or "")
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
            workers = c.get(r.admin + "/admin/workers").json()
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
            a = c.post(r.admin + "/admin/workers", json={"url": url})
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
                a = c.post(r.admin + "/admin/workers", json={"url": f"http://{host}:{port}"})
                assert a.status_code == 409, a.text
                assert f"'http://127.0.0.1:{port}' already exists (id 'real')" in a.text
            assert len(c.get(r.admin + "/admin/workers").json()["workers"]) == 1
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
        while metric(r.admin, "radixfleet_peer_hangups_total") < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(r.admin, "radixfleet_peer_hangups_total") == 40
        assert served(r.base, 3) == [200] * 3
        r.assert_settles(base)
        out = r.output()
    assert out.count("hung up before its request was read") == 40, out[-3000:]
    r.assert_no_tracebacks()


def test_a_registration_that_leads_to_the_router_itself_is_refused(upstream):
    """Finding: without an agent token, ``register {url: <the router's own URL>,
    models: [m2]}`` was accepted and the entry turned healthy; one request for m2
    then recursed router -> router 1,024 hops deep, open descriptors went 19 ->
    2,068 and other models' requests waited 27-29 s. Every spelling of the router's
    own address is now 400 worker_url_is_router (counted, logged); without the token
    a non-loopback worker is 403; a request for m2 is a prompt 404/503."""
    with RouterProcess(argv=["--worker", f"url={upstream},id=real"]) as r:
        wait_routable(r.base, 1)
        base = r.resources()
        selves = (
            r.base,
            f"http://localhost:{r.port}",
            f"http://0x7f.1:{r.port}/",
            f"http://[::ffff:127.0.0.1]:{r.port}",
            r.admin,  # the admin listener is the router's too
        )
        with httpx.Client(timeout=5) as c:
            for url in selves:
                g = c.post(
                    r.base + REGISTER, json={"worker_id": "loop", "url": url, "epoch": "e", "models": ["m2"]}
                )
                assert g.status_code == 400, (url, g.text)
                body = g.json()
                assert body["status"] == "worker_url_is_router" and body["error"]["param"] == "url", body
                assert "leads to this router itself" in body["error"]["message"], body
            far = c.post(
                r.base + REGISTER,
                json={"worker_id": "far", "url": "http://192.0.2.77:9000", "epoch": "e", "models": ["m2"]},
            )
            assert far.status_code == 403 and far.json()["status"] == "worker_host_not_allowed", far.text
            t0 = time.monotonic()
            for _ in range(8):
                resp = c.post(
                    r.base + "/v1/completions", json={"model": "m2", "prompt": "x", "max_tokens": 1}
                )
                assert resp.status_code in (404, 503), resp.text
            assert time.monotonic() - t0 < 5
            listed = c.get(r.admin + "/admin/workers").json()["workers"]
        assert [w["id"] for w in listed] == ["real"], listed
        assert served(r.base, 5) == [200] * 5
        refused = "radixfleet_registrations_refused_total"
        assert metric(r.admin, refused, 'reason="worker_url_is_router"') == len(selves)
        assert metric(r.admin, refused, 'reason="worker_host_not_allowed"') == 1
        r.assert_settles(base)
        out = r.stop()
    assert "refused registration: loop at http://127.0.0.1:" in out, out[-3000:]
    assert "refused registration: far at http://192.0.2.77:9000" in out, out[-3000:]
    r.assert_no_tracebacks()


def test_flapping_a_live_workers_registration_is_bounded_logged_and_counted(upstream):
    """Finding: a holder of the agent token re-registered a live worker's id and URL
    with a new epoch 143 times in 15 s, every one 200 (each one drops the worker's
    index entries), with no log line, and absurd load reports were accepted. Now
    the URL's new epochs stop at registration.epochs_per_min (429 epoch_churn with
    Retry-After, counted; accepted ones one log line each, refusals throttled), and
    a report using more KV than its own capacity is 400 naming the field."""
    auth = {"Authorization": "Bearer agent-secret"}
    with RouterProcess(
        argv=["--worker", f"url={upstream},id=w"], env={"RADIXFLEET_AGENT_TOKEN": "agent-secret"}
    ) as r:
        wait_routable(r.base, 1)
        codes, statuses, retry_after = [], set(), set()
        t0 = time.monotonic()
        with httpx.Client(timeout=5, headers=auth) as c:
            for i in range(143):
                g = c.post(
                    r.base + REGISTER,
                    json={"worker_id": "w", "url": upstream, "epoch": f"e{i}", "models": ["m"]},
                )
                codes.append(g.status_code)
                if g.status_code == 429:
                    statuses.add(g.json()["status"])
                    retry_after.add(g.headers.get("Retry-After", ""))
            took = time.monotonic() - t0
            # the default 10 a minute, plus what refilled meanwhile (one every 6 s)
            ok = codes.count(200)
            assert codes[:10] == [200] * 10 and ok <= 10 + took / 6 + 1, (codes, took)
            assert set(codes) == {200, 429} and statuses == {"epoch_churn"}, (codes, statuses)
            assert "" not in retry_after, retry_after
            bad = EventBatch("w", upstream, f"e{ok - 1}", 0, []).to_json()
            bad["load"] = {"kv_used_tokens": 10**9, "kv_capacity_tokens": 1000}
            ev = c.post(r.base + EVENTS, json=bad)
            assert ev.status_code == 400 and "'load.kv_used_tokens'" in ev.json()["error"]["message"], ev.text
            bad["load"] = {"queued_tokens": 10, "queued_prefill_tokens": 10**6}
            ev = c.post(r.base + EVENTS, json=bad)
            assert ev.status_code == 400 and "'load.queued_prefill_tokens'" in ev.text, ev.text
        assert metric(
            r.admin, "radixfleet_registrations_refused_total", 'reason="epoch_churn"'
        ) == codes.count(429)
        assert served(r.base, 5) == [200] * 5
        out = r.stop()
    # the configured entry's first registration is its first epoch: no "new epoch" yet
    assert out.count("worker w (" + upstream + ") registered a new epoch") == ok - 1, out[-3000:]
    refusals = out.count("refused registration of w (")
    assert 1 <= refusals <= took + 2, (refusals, took)
    r.assert_no_tracebacks()
