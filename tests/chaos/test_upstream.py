"""Broken workers against a live router process: what a worker sends back must stay
bounded (memory, descriptors) and reach the client well-formed and wrapped.

The worker here is a raw asyncio server in a thread of the test process, so it can
misbehave at the byte level (a 200 MB body, an event cut mid-line, CRLF events, a
stack trace). Each probe checks the router's RSS and open descriptors settle back
near their baseline and that it logged no traceback.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import httpx
import pytest

from radixfleet_tools.harness.router_process import RouterProcess

pytestmark = pytest.mark.integration

MB = 1 << 20
TRACE = (
    b'Traceback (most recent call last):\n  File "/srv/vllm/entrypoints/api.py", '
    b"line 1, in serve\nKeyError: 'engine'\n"
)


class MisbehavingWorker:
    """A worker on 127.0.0.1 whose answer is chosen by the request body's ``probe``:

    big           a 200 MB non-streamed body, chunked (no length said up front)
    big_stream    a 100 MB SSE stream of small events
    cut           one event, then ``data: {..."content":"hel`` and the connection closes
    crlf          CRLF-separated events, the first content token 1.5 s before the rest
    trace         a 500 with a Python stack trace as text/plain
    hangup        reads the request (it may have run it: counted in ``hangups``), then
                  closes the connection without a byte of answer, and stays healthy
    leak          answers (streamed if asked) with vLLM's ``kv_transfer_params`` naming
                  its engine, host and port

    Every request head it gets is kept in ``heads`` (lower-case names).
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.hangups = 0
        self.heads: list[dict[str, str]] = []
        self.body: dict = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MisbehavingWorker:
        self._thread.start()
        assert self._ready.wait(10), "fake worker did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                path = head.split(b" ")[1]
                if path != b"/v1/completions":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b'Content-Length: 11\r\n\r\n{"data":[]}'
                    )
                    await writer.drain()
                    continue
                self.body = json.loads(body)
                self.heads.append(
                    {
                        k.strip().lower().decode(): v.strip().decode()
                        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
                    }
                )
                probe = self.body.get("probe")
                await getattr(self, f"_{probe}")(writer)
                if probe not in ("trace", "leak"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _big(self, writer) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        block = b"x" * MB
        for _ in range(200):
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _big_stream(self, writer) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        event = b'data: {"choices":[{"text":"' + b"y" * 4000 + b'"}]}\n\n'
        batch = event * 256  # ~1 MB
        for _ in range(100):
            writer.write(b"%x\r\n%s\r\n" % (len(batch), batch))
            await writer.drain()
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()

    async def _cut(self, writer) -> None:
        part = (
            b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            b'data: {"choices":[{"index":0,"delta":{"content":"hel'
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(part), part)
        )
        await writer.drain()
        await asyncio.sleep(0.1)  # then the connection closes, mid-event

    async def _crlf(self, writer) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        events = [
            b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\r\n\r\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\r\n\r\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\r\n\r\n',
            b"data: [DONE]\r\n\r\n",
        ]
        for i, ev in enumerate(events):
            writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
            if i == 1:
                await asyncio.sleep(1.5)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _hangup(self, writer) -> None:
        self.hangups += 1  # the request was read: for all the router knows, it ran

    async def _leak(self, writer) -> None:
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "engine-secret-7",
            "remote_block_ids": [1, 2],
            "remote_host": "10.9.8.7",
            "remote_port": 5557,
        }
        if not self.body.get("stream"):
            data = json.dumps(
                {"id": "c", "choices": [{"index": 0, "text": "ok"}], "kv_transfer_params": params}
            ).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
            )
        else:
            events = b"".join(
                b"data: " + json.dumps(e).encode() + b"\n\n"
                for e in (
                    {"choices": [{"index": 0, "text": "o"}]},
                    {"choices": [{"index": 0, "text": "k"}], "kv_transfer_params": params},
                )
            )
            events += b"data: [DONE]\n\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(events), events)
            )
        await writer.drain()

    async def _trace(self, writer) -> None:
        writer.write(
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(TRACE), TRACE)
        )
        await writer.drain()


def _router(worker: MisbehavingWorker) -> RouterProcess:
    return RouterProcess(
        "listen: {port: {port}}\n"
        f"workers: [{{url: '{worker.url}', id: w, kind: openai}}]\n"
        "policy: {name: round_robin}\nreload: {watch: false}\n"
        "breaker: {failure_threshold: 1000}\n"
    )


def _post(r: RouterProcess, probe: str, **kw) -> httpx.Response:
    return httpx.post(
        f"{r.base}/v1/completions", timeout=60, json={"model": "m", "prompt": "x", "probe": probe, **kw}
    )


def _wait_routable(r: RouterProcess) -> None:
    deadline = time.monotonic() + 15
    while httpx.get(f"{r.base}/readiness", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, r.output()
        time.sleep(0.05)


def test_huge_non_streamed_answers_are_refused_not_held():
    # 4 workers' answers of 200 MB at once: each is cut at limits.max_response_bytes
    # (502, OpenAI shape) and the router's memory stays bounded and comes back.
    with MisbehavingWorker() as wk, _router(wk) as r:
        _wait_routable(r)
        base = r.resources()
        peak = [base.rss_bytes]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], r.resources().rss_bytes)
                time.sleep(0.02)

        t = threading.Thread(target=sample)
        t.start()
        out: list[httpx.Response] = []
        try:
            posts = [threading.Thread(target=lambda: out.append(_post(r, "big"))) for _ in range(4)]
            for p in posts:
                p.start()
            for p in posts:
                p.join(60)
        finally:
            stop.set()
            t.join()
        assert len(out) == 4
        for resp in out:
            assert resp.status_code == 502, resp.text[:300]
            assert resp.json()["error"]["code"] == "upstream_response_too_large"
        # 4 x 64 MiB held at most, plus the parser's and the allocator's slack
        assert peak[0] - base.rss_bytes < 400 * MB, (peak[0] - base.rss_bytes) // MB
        r.assert_settles(base, rss_slack=96 * MB)
    r.assert_no_tracebacks()


def test_a_huge_stream_is_passed_through_not_held():
    with MisbehavingWorker() as wk, _router(wk) as r:
        _wait_routable(r)
        base = r.resources()
        got = 0
        peak = base.rss_bytes
        with httpx.stream(
            "POST",
            f"{r.base}/v1/completions",
            timeout=60,
            json={"model": "m", "prompt": "x", "probe": "big_stream", "stream": True},
        ) as s:
            assert s.status_code == 200
            for chunk in s.iter_bytes():
                got += len(chunk)
                if got % (8 * MB) < len(chunk):
                    peak = max(peak, r.resources().rss_bytes)
        assert got > 100_000_000
        assert peak - base.rss_bytes < 64 * MB, (peak - base.rss_bytes) // MB
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_a_stream_cut_mid_event_ends_with_a_well_formed_error_event():
    with MisbehavingWorker() as wk, _router(wk) as r:
        _wait_routable(r)
        base = r.resources()
        resp = _post(r, "cut", stream=True)
        assert resp.status_code == 200
        text = resp.text
        events = [e for e in text.replace("\r\n", "\n").split("\n\n") if e]
        assert events[-1] == "data: [DONE]", text
        payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]  # every one JSON
        assert payloads[0]["choices"][0]["delta"]["content"] == "hi"
        assert payloads[-1]["error"]["code"] == "upstream_failed", payloads
        assert '"content":"hel' not in text  # the unfinished event was dropped
        assert wk.url.split("//")[1] not in text and "127.0.0.1" not in text
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_crlf_events_reach_the_client_as_they_come():
    # sse-starlette's CRLF separators: the first token must reach the client (and
    # the router's TTFT) when it is sent, not when the stream ends 1.5 s later
    with MisbehavingWorker() as wk, _router(wk) as r:
        _wait_routable(r)
        base = r.resources()
        t0 = time.monotonic()
        first_token_at = None
        body = b""
        with httpx.stream(
            "POST",
            f"{r.base}/v1/completions",
            timeout=30,
            json={"model": "m", "prompt": "x", "probe": "crlf", "stream": True},
        ) as s:
            for chunk in s.iter_raw():
                body += chunk
                if first_token_at is None and b"Hel" in body:
                    first_token_at = time.monotonic() - t0
        total = time.monotonic() - t0
        assert body.endswith(b"data: [DONE]\r\n\r\n") and b'"lo"' in body
        assert total >= 1.5 and first_token_at is not None and first_token_at < 1.0, (first_token_at, total)
        metrics = httpx.get(f"{r.admin}/metrics", timeout=5).text
        ttft = [l for l in metrics.splitlines() if l.startswith("radixfleet_ttft_seconds_sum")]
        assert ttft and float(ttft[0].split()[1]) < 1.0, ttft
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_a_worker_stack_trace_reaches_the_client_as_a_wrapped_502():
    with MisbehavingWorker() as wk, _router(wk) as r:
        _wait_routable(r)
        base = r.resources()
        for stream in (False, True):
            resp = _post(r, "trace", stream=stream)
            assert resp.status_code == 502, resp.text[:300]
            assert resp.headers["content-type"].startswith("application/json")
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "code", "param"}
            assert "Traceback" not in resp.text and "/srv/" not in resp.text
            assert wk.url.split("//")[1] not in resp.text and "127.0.0.1" not in resp.text
        r.assert_settles(base)
        # the worker's trace is in the router's log (quoted in one line), none of its own
        out = r.output()
    assert "KeyError" in out
    assert not any(line.startswith("Traceback") for line in out.splitlines()), out[-4000:]


def test_a_request_on_a_stopped_worker_moves_once_its_health_fails():
    # A worker process stopped with SIGSTOP takes connections (the kernel does) and
    # never answers: the request waiting on it must go to the other worker as soon
    # as the health checks mark it unhealthy, not after a timeout.
    import os
    import signal

    from radixfleet_tools.harness.procs import Proc, free_port

    procs, urls = [], []
    for name in ("a", "b"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs.append(
            Proc(
                [
                    sys.executable,
                    "-m",
                    "radixfleet_tools.bench.proxy",
                    "upstream",
                    "--port",
                    str(port),
                    "--name",
                    name,
                    "--model",
                    "m",
                ],
                ready_url=url + "/health",
            )
        )
        urls.append(url)
    with (
        procs[0],
        procs[1],
        RouterProcess(
            "listen: {port: {port}}\n"
            f"workers: [{{url: '{urls[0]}', id: a, kind: openai}}, "
            f"{{url: '{urls[1]}', id: b, kind: openai}}]\n"
            "policy: {name: round_robin}\nreload: {watch: false}\n"
            "health: {interval_s: 0.5, timeout_s: 0.3, failure_threshold: 2}\n"
            "response_headers: {worker_id: true}\n"
        ) as r,
    ):
        _wait_routable(r)
        base = r.resources()
        out: list[httpx.Response] = []
        t0 = time.monotonic()
        req = threading.Thread(
            target=lambda: out.append(
                httpx.post(
                    f"{r.base}/v1/completions", timeout=30, json={"model": "m", "prompt": "x", "delay_s": 1.0}
                )
            )
        )
        req.start()
        stopped = None
        deadline = time.monotonic() + 5
        while stopped is None and time.monotonic() < deadline:
            for p, u in zip(procs, urls):
                if httpx.get(u + "/stats", timeout=2).json()["requests"]:
                    stopped = p
                    break
            time.sleep(0.01)
        assert stopped is not None, "the request reached no worker"
        os.killpg(stopped.proc.pid, signal.SIGSTOP)
        try:
            req.join(30)
            took = time.monotonic() - t0
            assert out and out[0].status_code == 200, out and out[0].text[:300]
            other = "b" if stopped is procs[0] else "a"
            assert out[0].headers["x-radixfleet-worker"] == other
            # two failed checks (<= 3 intervals + timeouts), the move, the 1 s answer
            assert took < 4.5, took
        finally:
            os.killpg(stopped.proc.pid, signal.SIGCONT)
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_a_worker_that_hangs_up_after_reading_a_request_is_never_sent_it_again():
    # Both workers read each request (for all the router knows, they ran it) and close
    # without a byte of answer, staying healthy: the request runs once, the client gets
    # a 502 naming nothing internal, the log names the worker.
    with MisbehavingWorker() as wa, MisbehavingWorker() as wb:
        with RouterProcess(
            "listen: {port: {port}}\n"
            f"workers: [{{url: '{wa.url}', id: worker-alpha, kind: openai}}, "
            f"{{url: '{wb.url}', id: worker-beta, kind: openai}}]\n"
            "policy: {name: round_robin}\nreload: {watch: false}\n"
            "breaker: {failure_threshold: 1000}\n"
        ) as r:
            _wait_routable(r)
            base = r.resources()
            for i, stream in enumerate((False, True, False, True)):
                resp = _post(r, "hangup", stream=stream)
                assert resp.status_code == 502, resp.text[:300]
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "code", "param"} and err["code"] == "bad_gateway"
                for secret in ("worker-", "127.0.0.1", str(wa.port), str(wb.port)):
                    assert secret not in resp.text, resp.text
                assert wa.hangups + wb.hangups == i + 1  # once, on one worker
            assert wa.hangups == wb.hangups == 2  # round robin: each took its own
            r.assert_settles(base)
            out = r.output()
        assert "worker worker-alpha" in out and "no_answer" in out and "not retried" in out
    r.assert_no_tracebacks()


def test_hand_off_fields_never_reach_the_client_nor_a_clients_router_headers_the_worker():
    # A worker (vLLM with a KV connector) that reports kv_transfer_params, its
    # engine, host and port, in every answer: the client sees none of it, streamed or
    # not. A client's x-data-parallel-rank and tenant headers never reach the worker.
    with MisbehavingWorker() as wk, _router(wk) as r:
        _wait_routable(r)
        for stream in (False, True):
            resp = httpx.post(
                f"{r.base}/v1/completions",
                timeout=30,
                json={"model": "m", "prompt": "x", "probe": "leak", "stream": stream},
                headers={
                    "X-data-parallel-rank": "3",
                    "x-radixfleet-tenant": "someone-else",
                    "x-radixfleet-tenant-sig": "forged",
                },
            )
            assert resp.status_code == 200, resp.text[:300]
            for secret in ("kv_transfer_params", "engine-secret-7", "10.9.8.7", "5557"):
                assert secret not in resp.text, resp.text
            if stream:
                events = [e for e in resp.text.split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == "ok"
            else:
                assert resp.json()["choices"][0]["text"] == "ok"
        assert len(wk.heads) == 2  # the two completions (health checks are not kept)
        for h in wk.heads:
            assert "x-data-parallel-rank" not in h and "x-radixfleet-tenant-sig" not in h, h
            assert h.get("x-radixfleet-tenant") != "someone-else", h
    r.assert_no_tracebacks()
