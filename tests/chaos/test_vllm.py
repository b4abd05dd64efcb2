"""Broken vLLM peers against a live router process: what a server says about its KV
events (``/kv_event_sources``) and how it treats the data-parallel rank header can be
wrong in every way, and the router keeps serving every worker, logs no traceback and
settles back to its baseline memory and descriptors.

Peers (``tests.engines.fake_dp_vllm.FakeDpVllm``, in a thread of this process):
an answer of 3 MiB, one nested 100,000 deep, 5,000 ranks, a NaN endpoint, a server
that lists two ranks but refuses rank 1 (a rank map it contradicts is dropped and
not taken again), a concrete endpoint the router must bind while another socket
holds it ("Address already in use"), and endpoints that point off the worker's
host (a TCP address elsewhere, a unix socket on the router's host).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import zmq
from aiohttp import web

from radixfleet.engines.token_keys import TokenKeyer
from radixfleet_tools.bench.tiny_tokenizer import build as build_tokenizer
from radixfleet_tools.harness.procs import free_port
from radixfleet_tools.harness.router_process import RouterProcess
from tests.engines.fake_dp_vllm import MODEL, FakeDpVllm, _src, prompt

pytestmark = pytest.mark.integration


class Peers:
    """Fake servers served from an event loop in a thread of their own."""

    def __init__(self, make) -> None:
        self._make = make  # () -> {worker id: FakeDpVllm}, called in the thread's loop
        self.urls: dict[str, str] = {}
        self.fakes: dict = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self.fakes = self._make()
        self._runners = []
        for wid, fake in self.fakes.items():
            runner = web.AppRunner(fake.app())
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self._runners.append(runner)
            self.urls[wid] = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        for r in self._runners:
            await r.cleanup()
        for f in self.fakes.values():
            f.close()

    def __enter__(self) -> Peers:
        self._thread.start()
        assert self._ready.wait(30), "fake peers did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_broken_event_sources_and_rank_answers_leave_every_worker_serving(tmp_path):
    tok = build_tokenizer(str(tmp_path / "tok"))
    keyer = TokenKeyer.load(tok)
    squatter = zmq.Context.instance().socket(zmq.PULL)
    busy_port = squatter.bind_to_random_port("tcp://127.0.0.1")

    def make():
        f = {w: FakeDpVllm(keyer, ranks=1) for w in ("huge", "deep", "many", "nan", "busy")}
        f["huge"].sources = (200, json.dumps({"0": {**_src(1), "pad": "x" * (3 << 20)}}))
        f["deep"].sources = (200, "[" * 100_000 + "]" * 100_000)
        f["many"].sources = (200, json.dumps({str(r): _src(1000 + r) for r in range(5000)}))
        f["nan"].sources = (200, '{"0": {"endpoint": NaN, "topic": "kv-events"}}')
        f["busy"].sources = (200, json.dumps({"0": {**_src(0), "endpoint": f"tcp://127.0.0.1:{busy_port}"}}))
        liar = f["liar"] = FakeDpVllm(keyer, ranks=2)
        liar.ranks = 1  # lists two ranks, refuses rank 1
        return f

    try:
        with Peers(make) as peers:
            workers = [
                {
                    "url": u,
                    "id": w,
                    "kind": "vllm",
                    "tokenizer": tok,
                    "block_size": 16,
                    "metrics": {"path": ""},
                }
                for w, u in peers.urls.items()
            ]
            cfg = json.dumps(
                {
                    "listen": {"host": "127.0.0.1", "port": "{port}"},
                    "health": {"interval_s": 0.2},
                    "workers": workers,
                    "limits": {"worker_queue_requests": 0},
                    "response_headers": {"worker_id": True},
                }
            ).replace('"{port}"', "{port}")
            with RouterProcess(cfg) as r:
                want = {
                    "huge": "malformed",
                    "deep": "malformed",
                    "many": "malformed",
                    "nan": "malformed",
                    "busy": "address_in_use",
                }

                def counted(text: str) -> bool:
                    return all(
                        f'radixfleet_engine_events_unavailable_total{{cause="{c}",worker="{w}"}}' in text
                        for w, c in want.items()
                    )

                end = time.monotonic() + 20
                text = ""
                while time.monotonic() < end and not counted(text):
                    time.sleep(0.2)
                    text = httpx.get(r.admin + "/metrics", timeout=5).text
                assert counted(text), text[-3000:]
                base = r.resources()  # tokenizer loaded, every source asked and refused
                served = {}
                with httpx.Client(timeout=30) as c:
                    for i in range(40):
                        resp = c.post(
                            r.base + "/v1/completions",
                            json={"model": MODEL, "prompt": prompt(300 + i, 60), "max_tokens": 1},
                        )
                        assert resp.status_code == 200, resp.text
                        wid = resp.headers["x-radixfleet-worker"]
                        served[wid] = served.get(wid, 0) + 1
                assert "1" in peers.fakes["liar"].headers, peers.fakes["liar"].headers
                text = httpx.get(r.admin + "/metrics", timeout=5).text
                assert (
                    'radixfleet_engine_events_unavailable_total{cause="rank_rejected",worker="liar"} 1.0'
                ) in text
                # the contradicting rank map is not taken again: no header after it
                liar = peers.fakes["liar"].headers
                assert liar.count("1") == 1, liar
                assert 'radixfleet_worker_data_parallel_ranks{worker="liar"} 0.0' in text
                r.assert_settles(base)
                # read before the with block ends: its exit removes the log
                out = r.stop()
                assert "Traceback" not in out, out[-4000:]
                assert out.count("worker busy: KV events not followed") == 1, out[-3000:]
                for w in ("huge", "deep", "many", "nan"):
                    assert out.count(f"worker {w}: no KV events to follow") == 1, w
    finally:
        squatter.close(0)


class Accepts:
    """A listening socket (TCP or unix) in a thread that counts the connections it
    accepts and closes each at once."""

    def __init__(self, family: int, addr) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(addr)
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def test_event_sources_cannot_aim_the_router_off_the_workers_host(tmp_path):
    """Finding: a worker's ``/kv_event_sources`` aimed the router anywhere: it kept
    connecting to an arbitrary TCP address and to a unix socket on its own host
    named there, 8.5 connections a second. Now only tcp:// on the worker's own host
    is followed: a replay endpoint elsewhere, an ipc:// endpoint and a concrete
    endpoint elsewhere (which the router would bind) are each one log line and
    not_allowed, nothing is dialled or bound, and every worker keeps serving."""
    tok = build_tokenizer(str(tmp_path / "tok"))
    keyer = TokenKeyer.load(tok)
    # 127.0.0.2 is this host but not the workers' address (127.0.0.1)
    tcp = Accepts(socket.AF_INET, ("127.0.0.2", 0))
    unix_path = str(tmp_path / "engine.sock")
    unix = Accepts(socket.AF_UNIX, unix_path)
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        bind_port = s.getsockname()[1]

    def make():
        f = {w: FakeDpVllm(keyer, ranks=1) for w in ("replay", "unix", "bind")}
        rep = f["replay"]
        rep.sources = (
            200,
            json.dumps({"0": _src(rep.ports[0], f"tcp://127.0.0.2:{tcp.sock.getsockname()[1]}")}),
        )
        f["unix"].sources = (200, json.dumps({"0": {**_src(0), "endpoint": f"ipc://{unix_path}"}}))
        f["bind"].sources = (200, json.dumps({"0": {**_src(0), "endpoint": f"tcp://127.0.0.2:{bind_port}"}}))
        return f

    try:
        with Peers(make) as peers:
            workers = [
                {
                    "url": u,
                    "id": w,
                    "kind": "vllm",
                    "tokenizer": tok,
                    "block_size": 16,
                    "metrics": {"path": ""},
                }
                for w, u in peers.urls.items()
            ]
            cfg = json.dumps(
                {
                    "listen": {"host": "127.0.0.1", "port": "{port}"},
                    "health": {"interval_s": 0.2},
                    "workers": workers,
                    "limits": {"worker_queue_requests": 0},
                    "response_headers": {"worker_id": True},
                }
            ).replace('"{port}"', "{port}")
            with RouterProcess(cfg) as r:

                def refused(text: str) -> bool:
                    return all(
                        f'radixfleet_engine_events_unavailable_total{{cause="not_allowed",worker="{w}"}}'
                        in text
                        for w in peers.urls
                    )

                end = time.monotonic() + 20
                text = ""
                while time.monotonic() < end and not refused(text) and not (tcp.count or unix.count):
                    time.sleep(0.2)
                    text = httpx.get(r.admin + "/metrics", timeout=5).text
                time.sleep(1.5)  # a router that dials them does so within this, several times
                assert (tcp.count, unix.count) == (0, 0), (tcp.count, unix.count)
                assert not _listening("127.0.0.2", bind_port), "the router bound an address a worker named"
                assert refused(text), text[-3000:]
                with httpx.Client(timeout=30) as c:
                    seen = set()
                    for i in range(12):
                        resp = c.post(
                            r.base + "/v1/completions",
                            json={"model": MODEL, "prompt": prompt(500 + i, 40), "max_tokens": 1},
                        )
                        assert resp.status_code == 200, resp.text
                        seen.add(resp.headers["x-radixfleet-worker"])
                assert seen == set(peers.urls), seen
                out = r.stop()
                assert "Traceback" not in out, out[-4000:]
                for w in peers.urls:
                    lines = [
                        ln
                        for ln in out.splitlines()
                        if f"worker {w}: no KV events to follow (not_allowed" in ln
                    ]
                    assert len(lines) == 1, (w, out[-3000:])
                assert "not on the worker's host 127.0.0.1" in out and "is not tcp://" in out
    finally:
        tcp.close()
        unix.close()
