"""Attacks on the router's client-facing side, each against a live router process.

A client on loopback tries to exhaust what the router holds for it before its request
is admitted: admission slots (a body trickled after a hand-over to aiohttp), memory
(bodies one byte short, a pipeline whose every read ends mid-request), CPU (large
bodies without credentials), descriptors (idle connections past the open-file
limit), and the head bound (large pipelined requests); and after: slots, memory and
a healthy worker's breaker (clients that never read their stream, streams cut at the
total deadline). Each probe asserts the answer
the attacker gets, that legitimate requests keep working (TTFT p50 within twice the
unloaded one where the attack competes for the router), that RSS and open
descriptors stay bounded and settle, and that the router answers nothing >= 500 and
logs no traceback. Scales are the smallest that still show each failure; limits are
configured small where that keeps a probe cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import resource
import socket
import statistics
import time

import httptools
import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port
from radixfleet_tools.harness.router_process import RouterProcess

pytestmark = pytest.mark.integration

KEY = "sk-chaos-front"
AUTH = f"Authorization: Bearer {KEY}\r\n"
MiB = 1 << 20


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    argv = ["python3", "-m", "radixfleet_tools.bench.proxy", "upstream", "--port", str(port), "--chunks", "2"]
    with Proc(argv, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def _config(upstream: str, limits: dict, timeouts: dict | None = None) -> str:
    """A router on one upstream, tenants by API key (``KEY``), with ``limits`` (and
    ``timeouts``)."""
    lim = ", ".join(f"{k}: {v}" for k, v in limits.items())
    tmo = ", ".join(f"{k}: {v}" for k, v in (timeouts or {}).items())
    return (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {upstream}, id: up}}]\n"
        f"keys: {{tenant: {{source: api_key, api_keys: [{{tenant: a, key: {KEY}}}]}}}}\n"
        f"limits: {{{lim}}}\n"
        + (f"timeouts: {{{tmo}}}\n" if tmo else "")
        + "warmup: {enabled: false}\nreload: {watch: false}\n"
    )


def _completion(
    n_prompt: int = 16, *, stream: bool = False, key: bool = True, close: bool = False, **fields
) -> bytes:
    """A completion request; ``fields`` go into its body (the upstream's ``chunks``,
    ``chunk_delay_s``: radixfleet_tools.bench.proxy)."""
    body = json.dumps(
        {"model": "tiny", "prompt": "p" * n_prompt, "max_tokens": 2, "stream": stream, **fields}
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        + (AUTH.encode() if key else b"")
        + (b"Connection: close\r\n" if close else b"")
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


class _Responses:
    """HTTP/1.1 responses parsed from a byte stream: ``statuses``, ``bodies``, ``heads``."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self.heads: list[dict] = []
        self._body: list[bytes] = []
        self._head: dict = {}
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())
        self.bodies.append(b"".join(self._body))
        self.heads.append(self._head)
        self._body, self._head = [], {}

    def feed(self, data: bytes) -> None:
        self.parser.feed_data(data)


async def _read_responses(reader: asyncio.StreamReader, n: int, timeout_s: float) -> _Responses:
    """Reads until ``n`` responses are complete, EOF or ``timeout_s``."""
    out = _Responses()
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, httptools.HttpParserError):
        while len(out.statuses) < n:
            data = await asyncio.wait_for(reader.read(1 << 16), deadline - time.monotonic())
            if not data:
                break
            out.feed(data)
    return out


async def _ttft(port: int) -> float:
    """Seconds from sending a streamed completion to its first event (a fresh
    connection each time, as a new client)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.monotonic()
        writer.write(_completion(stream=True, close=True))
        seen = b""
        while b"data:" not in seen:
            data = await asyncio.wait_for(reader.read(1 << 16), 10.0)
            assert data, f"closed before the first event: {seen[:300]!r}"
            seen += data
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
        return time.monotonic() - t0
    finally:
        writer.close()


async def _ttft_p50(port: int, n: int, pause_s: float = 0.02) -> float:
    samples = []
    for _ in range(n):
        samples.append(await _ttft(port))
        await asyncio.sleep(pause_s)
    return statistics.median(samples)


def _assert_ttft(during: float, base: float) -> None:
    # twice the unloaded p50, and 25 ms for the scheduling jitter of a 2-core CI host
    assert during <= 2 * base + 0.025, (
        f"TTFT p50 {during * 1e3:.1f} ms under attack, {base * 1e3:.1f} ms unloaded"
    )


def _json_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert err["message"] and err["code"], err
    return err


def _metric(r: RouterProcess, name: str) -> float:
    text = httpx.get(f"{r.admin}/metrics", timeout=5).text
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def _finish(r: RouterProcess, base, *, rss_slack: int = 64 * MiB, fd_slack: int = 16) -> None:
    """Nothing answered >= 500 (the router's own refusals and the workers' answers it
    passed on), resources back near ``base``, no traceback in the log."""
    text = httpx.get(f"{r.admin}/metrics", timeout=5).text
    assert not re.search(r'status="5\d\d"', text), "the router answered >= 500:\n" + "\n".join(
        line for line in text.splitlines() if 'status="5' in line
    )
    r.assert_settles(base, rss_slack=rss_slack, fd_slack=fd_slack)
    r.assert_no_tracebacks()


class _Peak:
    """The router's peak RSS and open fds, sampled every 50 ms by a task on the probe's
    event loop while the probe runs."""

    def __init__(self, r: RouterProcess) -> None:
        self.r = r
        self.rss = 0
        self.fds = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            res = self.r.resources()
            self.rss, self.fds = max(self.rss, res.rss_bytes), max(self.fds, res.open_fds)
            await asyncio.sleep(0.05)

    async def __aenter__(self) -> _Peak:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# ------------------------------------------------------------------------- probes


def test_a_body_trickled_after_a_hand_over_holds_no_slot_and_meets_its_deadline(upstream):
    """GET then a POST whose body trickles, on connections handed to aiohttp: the
    trickled bodies get 408 at the body deadline (401 at once without a key) and hold
    no admission slot meanwhile, so legitimate requests keep their TTFT."""
    limits = {"max_concurrency": 4, "max_queue": 16, "queue_timeout_s": 3.0, "body_timeout_s": 2.0}
    with RouterProcess(_config(upstream, limits)) as r:
        base_res = r.resources()

        async def attacker(keyed: bool) -> _Responses:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
                first = await _read_responses(reader, 1, 5.0)
                assert first.statuses == [200]
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: "
                    b"application/json\r\n"
                    + (AUTH.encode() if keyed else b"")
                    + b"Content-Length: 1000\r\n\r\n{"
                )
                out = _Responses()
                t_end = time.monotonic() + 5.0
                while time.monotonic() < t_end and not out.statuses:
                    with contextlib.suppress(ConnectionError):
                        writer.write(b" ")
                    with contextlib.suppress(asyncio.TimeoutError):
                        data = await asyncio.wait_for(reader.read(1 << 16), 0.25)
                        if not data:
                            break
                        out.feed(data)
                return out
            finally:
                writer.close()

        async def probe():
            base = await _ttft_p50(r.port, 12)
            attack = [asyncio.create_task(attacker(keyed=i % 2 == 0)) for i in range(12)]
            await asyncio.sleep(0.3)
            async with _Peak(r) as peak:
                during = await _ttft_p50(r.port, 12, pause_s=0.1)
                answers = await asyncio.gather(*attack)
            return base, during, answers, peak

        base, during, answers, peak = asyncio.run(probe())
        keyed = [a for i, a in enumerate(answers) if i % 2 == 0]
        keyless = [a for i, a in enumerate(answers) if i % 2 == 1]
        assert [a.statuses for a in keyless] == [[401]] * 6
        assert [a.statuses for a in keyed] == [[408]] * 6
        assert all(_json_error(a.bodies[0])["code"] for a in answers)
        _assert_ttft(during, base)
        assert peak.fds <= base_res.open_fds + 12 + 16
        _finish(r, base_res)


def test_bodies_one_byte_short_are_bounded_by_the_body_budget(upstream):
    """Connections sending large bodies one byte short: what the router holds of them
    all together stays within limits.max_buffered_body_bytes (429 + Retry-After past
    it), the rest get 408 at the deadline, RSS stays within baseline + budget + 64 MiB."""
    budget = 16 * MiB
    limits = {"max_buffered_body_bytes": budget, "body_timeout_s": 2.0}
    size = 6 * MiB
    with RouterProcess(_config(upstream, limits)) as r:
        base_res = r.resources()

        async def flood() -> _Responses:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                    + AUTH.encode()
                    + b"Content-Length: %d\r\n\r\n" % size
                )
                piece = b"x" * MiB
                sent = 0
                with contextlib.suppress(ConnectionError):
                    while sent < size - 1:
                        n = min(len(piece), size - 1 - sent)
                        writer.write(piece[:n])
                        await writer.drain()
                        sent += n
                return await _read_responses(reader, 1, 6.0)
            finally:
                writer.close()

        async def probe():
            async with _Peak(r) as peak:
                answers = await asyncio.gather(*(flood() for _ in range(8)))
            return answers, peak

        answers, peak = asyncio.run(probe())
        statuses = sorted(s for a in answers for s in a.statuses)
        assert len(statuses) == 8 and set(statuses) <= {408, 429}, statuses
        assert 429 in statuses, statuses  # 8 x 6 MiB do not fit a 16 MiB budget
        for a in answers:
            if a.statuses == [429]:
                assert _json_error(a.bodies[0])["code"] == "body_budget_exhausted"
                assert a.heads[0]["retry-after"] == "1"
        assert peak.rss <= base_res.rss_bytes + budget + 64 * MiB, (
            f"RSS peak {peak.rss >> 20} MiB, baseline {base_res.rss_bytes >> 20} MiB"
        )
        assert (
            httpx.post(
                f"{r.base}/v1/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": "tiny", "prompt": "ok"},
                timeout=10,
            ).status_code
            == 200
        )
        _finish(r, base_res)


def test_a_pipeline_whose_reads_end_mid_request_keeps_no_more_than_one_request(upstream):
    """Pipelined requests sent so that every read ends inside a request: all are
    answered, and the bytes kept for a possible hand-over are cut at every completed
    request, so RSS stays flat."""
    per_conn, conns = 100, 4
    with RouterProcess(_config(upstream, {})) as r:
        base_res = r.resources()
        one = _completion(100_000)
        stream = one * per_conn

        async def pipeline() -> _Responses:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                answers = asyncio.create_task(_read_responses(reader, per_conn, 60.0))
                step = len(one) * 3 + 4099  # never a request boundary
                for i in range(0, len(stream), step):
                    writer.write(stream[i : i + step])
                    await writer.drain()
                return await answers
            finally:
                writer.close()

        async def probe():
            async with _Peak(r) as peak:
                answers = await asyncio.gather(*(pipeline() for _ in range(conns)))
            return answers, peak

        answers, peak = asyncio.run(probe())
        assert [a.statuses for a in answers] == [[200] * per_conn] * conns
        sent = per_conn * conns * len(one)
        assert peak.rss <= base_res.rss_bytes + 24 * MiB, (
            f"RSS peak {peak.rss >> 20} MiB after {sent >> 20} MiB pipelined, baseline "
            f"{base_res.rss_bytes >> 20} MiB"
        )
        _finish(r, base_res)


def test_a_request_without_credentials_is_refused_from_its_head(upstream):
    """Large bodies without an API key: 401 as soon as the head is in (no body byte
    needs to arrive), so such a flood costs no parsing and legitimate requests keep
    their TTFT."""
    big = b'{"model": "tiny", "prompt": "' + b"a" * (8 * MiB - 64) + b'"}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(big)
    )
    with RouterProcess(_config(upstream, {})) as r:
        base_res = r.resources()

        async def head_only() -> _Responses:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                writer.write(head + big[:1024])
                return await _read_responses(reader, 1, 2.0)
            finally:
                writer.close()

        async def flooder(done: asyncio.Event) -> list[int]:
            # sends the whole body unless an answer arrives first (as a client
            # watching for an early answer does), every 200 ms at most
            got = []
            while not done.is_set():
                next_at = time.monotonic() + 0.2  # 5 requests/s per client at most
                reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
                try:
                    answer = asyncio.create_task(_read_responses(reader, 1, 10.0))
                    writer.write(head)
                    with contextlib.suppress(ConnectionError):
                        for i in range(0, len(big), MiB):
                            if answer.done():
                                break
                            writer.write(big[i : i + MiB])
                            await writer.drain()
                    got += (await answer).statuses
                finally:
                    writer.close()
                await asyncio.sleep(next_at - time.monotonic())
            return got

        async def probe():
            early = await head_only()
            base = await _ttft_p50(r.port, 15)
            done = asyncio.Event()
            flood = [asyncio.create_task(flooder(done)) for _ in range(3)]
            await asyncio.sleep(0.2)
            during = await _ttft_p50(r.port, 15)
            done.set()
            return early, base, during, await asyncio.gather(*flood)

        early, base, during, flood = asyncio.run(probe())
        assert early.statuses == [401], early.statuses
        assert all(flood) and {s for got in flood for s in got} == {401}, flood
        assert _json_error(early.bodies[0])["code"] == "unauthorized"
        _assert_ttft(during, base)
        _finish(r, base_res)


def test_idle_connections_past_the_fd_limit_do_not_lock_clients_out(upstream):
    """More idle connections than the open-file limit the router started with: the
    router raises its soft limit, caps client connections (limits.max_connections),
    closes the longest-idle one to make room, logs and counts it; a new client is
    served."""
    cap = 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"hard open-file limit {hard} too low to show the soft limit raised")
    child_soft = 96  # what the router starts with: fewer than the idle connections
    resource.setrlimit(resource.RLIMIT_NOFILE, (child_soft, hard))
    try:
        r = RouterProcess(_config(upstream, {"max_connections": cap}))
        r.__enter__()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        base_res = r.resources()

        async def probe():
            idle = []
            for _ in range(150):
                idle.append(await asyncio.open_connection("127.0.0.1", r.port))
            await asyncio.sleep(0.3)
            peak = r.resources()
            ttft = await asyncio.wait_for(_ttft(r.port), 5.0)
            for _, w in idle:
                w.close()
            return peak, ttft

        peak, _ = asyncio.run(probe())
        assert peak.open_fds <= base_res.open_fds + cap + 16, peak
        assert _metric(r, "radixfleet_connections_refused_total") >= 150 - cap
        assert "client connections at the cap of 64" in r.output()
        _finish(r, base_res)
    finally:
        r.__exit__(None, None, None)


def test_large_pipelined_requests_are_judged_by_their_own_head(upstream):
    """Pipelined 100 KB requests, read so that a whole request and the start of the
    next head arrive together: no false 431 for the requests after the first (only
    the current head's bytes count), and a burst of them is served in full."""
    one = _completion(100_000)
    with RouterProcess(_config(upstream, {})) as r:
        base_res = r.resources()

        async def burst(n: int) -> _Responses:
            # every write but the last ends 50 bytes into the next request's head, so
            # the router reads a whole request and the start of the next head at once
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                answers = asyncio.create_task(_read_responses(reader, n, 60.0))
                stream = one * n
                cuts = [0] + [i * len(one) + 50 for i in range(1, n)] + [len(stream)]
                for a, b in zip(cuts, cuts[1:]):
                    writer.write(stream[a:b])
                    await writer.drain()
                    await asyncio.sleep(0.002)
                return await answers
            finally:
                writer.close()

        async def probe():
            return await burst(2), await burst(200)

        two, many = asyncio.run(probe())
        assert two.statuses == [200, 200], two.bodies
        assert many.statuses == [200] * 200, (len(many.statuses), set(many.statuses))
        _finish(r, base_res)


def test_models_authenticates_like_the_data_plane(upstream):
    """``GET /v1/models`` with a wrong or no API key: 401, as a completion gets."""
    with RouterProcess(_config(upstream, {})) as r:
        base_res = r.resources()
        url = f"{r.base}/v1/models"
        wrong = httpx.get(url, headers={"Authorization": "Bearer sk-wrong"}, timeout=5)
        assert wrong.status_code == 401 and _json_error(wrong.content)["code"] == "unauthorized"
        assert httpx.get(url, timeout=5).status_code == 401
        ok = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        assert ok.status_code == 200 and ok.json()["data"], ok.text
        chat = httpx.post(
            f"{r.base}/v1/chat/completions",
            headers={"Authorization": "Bearer sk-wrong"},
            json={"model": "tiny", "messages": []},
            timeout=5,
        )
        assert chat.status_code == 401
        _finish(r, base_res)


def test_a_cancel_storm_is_counted_not_logged_as_errors():
    """400 streams, 128 running and the rest waiting for a slot, their clients gone
    at once: a client's departure, at any point, is an expected event (counted in
    radixfleet_client_disconnects_total, logged at debug), never a traceback, and
    nothing stays counted in flight."""
    n, slots = 400, 128
    port = free_port()
    argv = [
        "python3",
        "-m",
        "radixfleet_tools.bench.proxy",
        "upstream",
        "--port",
        str(port),
        "--chunks",
        "400",
        "--chunk-delay",
        "0.01",
    ]
    with (
        Proc(argv, ready_url=f"http://127.0.0.1:{port}/health"),
        RouterProcess(config=_config(f"http://127.0.0.1:{port}", {"max_concurrency": slots})) as r,
    ):
        base = r.resources()

        async def storm() -> None:
            conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", r.port) for _ in range(n)))
            for _, w in conns:
                w.write(_completion(stream=True))
            deadline = time.monotonic() + 20
            while _metric(r, "radixfleet_in_flight") < slots:  # every slot streaming
                assert time.monotonic() < deadline, r.output()[-2000:]
                await asyncio.sleep(0.05)
            for _, w in conns:
                w.transport.abort()

        asyncio.run(storm())
        deadline = time.monotonic() + 10
        while _metric(r, "radixfleet_in_flight"):
            assert time.monotonic() < deadline, _metric(r, "radixfleet_in_flight")
            time.sleep(0.05)
        _finish(r, base)
        out = r.output()
        assert "handler failed" not in out and "ERROR" not in out, out[-3000:]
        assert _metric(r, "radixfleet_client_disconnects_total") == n


def _never_reads(port: int) -> socket.socket:
    """A client with a 4 KiB receive buffer that asks for an endless stream and never
    reads a byte of it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(_completion(stream=True, chunks=10**9, events_per_write=64))
    return s


def test_clients_that_never_read_are_dropped_and_free_their_slots(upstream):
    """32 clients ask for an endless stream and never read it, holding every slot: each
    is dropped once it took nothing for timeouts.client_idle_s (logged, counted), its
    slot and upstream request freed, so legitimate requests queued behind them are
    served; the router holds a bounded buffer per stalled stream, and the worker's
    breaker stays closed."""
    n = 32
    limits = {"max_concurrency": n, "max_queue": 64, "queue_timeout_s": 10.0}
    timeouts = {"total_s": 120, "first_byte_s": 5, "client_idle_s": 1.0}
    with RouterProcess(_config(upstream, limits, timeouts)) as r:

        async def probe():
            base_ttft = await _ttft_p50(r.port, 12)
            base = r.resources()
            async with _Peak(r) as peak:
                readers = [_never_reads(r.port) for _ in range(n)]
                try:
                    await asyncio.sleep(0.5)  # every slot held, every buffer full
                    t0 = time.monotonic()
                    queued = await asyncio.gather(*(_ttft(r.port) for _ in range(8)))
                    waited = time.monotonic() - t0
                    during = await _ttft_p50(r.port, 12)
                    t_end = time.monotonic() + 10.0  # every one dropped, none closed by us
                    while _metric(r, "radixfleet_slow_clients_dropped_total") < n:
                        assert time.monotonic() < t_end, "not every client that never reads was dropped"
                        await asyncio.sleep(0.1)
                finally:
                    for s in readers:
                        s.close()
            return base_ttft, base, peak, queued, waited, during

        base_ttft, base, peak, queued, waited, during = asyncio.run(probe())
        assert len(queued) == 8 and waited < 6.0, f"queued requests served after {waited:.1f}s"
        _assert_ttft(during, base_ttft)
        assert _metric(r, "radixfleet_slow_clients_dropped_total") == n
        assert _metric(r, "radixfleet_in_flight") == 0  # every upstream request released
        assert _metric(r, "radixfleet_worker_breaker_state") == 0
        # the stalled streams' buffers: 64 KiB toward the client, the relay's pause
        # mark toward the worker, and one read of each (before: ~3.8 MB each)
        assert peak.rss <= base.rss_bytes + n * 640 * 1024, (
            f"peak RSS {peak.rss >> 20} MiB, baseline {base.rss_bytes >> 20} MiB"
        )
        assert "took none of its answer for 1s (timeouts.client_idle_s): dropped" in r.output()
        _finish(r, base)


def test_the_total_deadline_binds_while_the_router_waits_for_a_client(upstream):
    """A client that never reads holds the only slot: it is dropped at its request's
    total deadline although client_idle_s is longer, and the request queued behind it
    is served."""
    limits = {"max_concurrency": 1, "max_queue": 4, "queue_timeout_s": 10.0}
    with RouterProcess(_config(upstream, limits, {"total_s": 2.0, "client_idle_s": 60})) as r:
        base = r.resources()

        async def probe() -> float:
            s = _never_reads(r.port)
            try:
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                await _ttft(r.port)
                return time.monotonic() - t0
            finally:
                s.close()

        waited = asyncio.run(probe())
        assert waited < 5.0, waited
        assert _metric(r, "radixfleet_slow_clients_dropped_total") == 1
        assert "at its request's total deadline (timeouts.total_s): dropped" in r.output()
        _finish(r, base)


def test_streams_cut_at_the_total_deadline_leave_a_healthy_workers_breaker_closed(upstream):
    """A worker streaming slowly (~10 KB/s) without end: four streams read to their end
    are cut at timeouts.total_s, each ending with a well-formed error event, and the
    worker's breaker stays closed (three cuts would open it were they counted): the
    next request is served."""
    limits = {"max_concurrency": 8}
    with RouterProcess(_config(upstream, limits, {"total_s": 1.0, "first_byte_s": 5})) as r:
        base = r.resources()

        async def reader() -> _Responses:
            rd, wr = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                wr.write(_completion(stream=True, close=True, chunks=10**9, chunk_delay_s=0.013))
                return await _read_responses(rd, 1, 10.0)
            finally:
                wr.close()

        async def probe():
            cut = await asyncio.gather(*(reader() for _ in range(4)))
            return cut, await _ttft(r.port)

        cut, _ = asyncio.run(probe())
        for out in cut:
            assert out.statuses == [200]
            body = out.bodies[0]
            assert body.count(b"data: ") > 10 and body.endswith(b"data: [DONE]\n\n"), body[-300:]
            assert b'"upstream_failed"' in body
        assert _metric(r, "radixfleet_worker_breaker_state") == 0
        assert "breaker open" not in r.output()
        r.assert_settles(base)
        r.assert_no_tracebacks()
