"""Clients that never read, against a router with the default settings.

    python3 bench/slow_readers.py [--readers 200] [--clients 16] [--seconds 20]
                                  [--ramp-s 15] [--settle-s 20] [--rounds 3]
                                  [--client-idle-s S] [--json FILE]

Starts the bench upstream (``radixfleet_tools.bench.proxy upstream``: fast, and a stream
without end for a body that asks for one) and one router in front of it with nothing
but ``listen`` and ``workers`` configured, then alternates two phases per round,
each ``--seconds`` long: legitimate clients alone (``--clients`` closed loops of
streamed completions, 8 events each, a fresh connection per request), then the same
clients beside ``--readers`` clients, in a process of their own, that ask for an
endless stream (~130 KB/s) with a 4 KiB receive buffer and Ethernet-sized segments
and never read a byte. The readers are opened evenly over ``--ramp-s`` and each is
replaced as soon as the router drops it, so the attack stays at full strength and
its drops and reconnections come evenly (about ``readers / client_idle_s`` a
second); the phase beside them starts ``--settle-s`` after the first opens. Prints,
per phase kind, the legitimate requests' throughput and TTFT (p50, p99: the median
over the rounds) and the router's and the worker's CPU (seconds per second, and the
router's per legitimate request); the median over the rounds of each round's
attacked/alone ratios (throughput, p99 TTFT: the machine's other load moves them
least); the router's RSS (its baseline before the first attack, its peak during the
attacks, sampled every 0.5 s), the clients it dropped
(``radixfleet_slow_clients_dropped_total``), the requests it answered >= 500 and
whether the worker's breaker ever opened (sampled every 2 s).

Why: what clients that never read cost the others (their throughput and p99 TTFT
beside the readers against alone), what they cost the router (RSS), and that no
breaker opens on the healthy worker. Bounded: ``rounds * (2 * seconds + settle_s +
1)`` seconds of load plus the start; loopback only. Run it from a checkout to
measure that checkout's router (one from before ``timeouts.client_idle_s`` refuses
``--client-idle-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.vllm_ab import cpu_s  # noqa: E402
from radixfleet_tools.harness.procs import Proc, free_port  # noqa: E402
from radixfleet_tools.harness.router_process import RouterProcess  # noqa: E402

_LEGIT = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 8, "stream": True}).encode()
#: a stream without end, ~130 KB/s (512 events every 0.5 s: faster than an engine's
#: one stream, so the readers' buffers fill in seconds)
_ENDLESS = json.dumps(
    {
        "model": "tiny",
        "prompt": "never read",
        "stream": True,
        "chunks": 10**9,
        "events_per_write": 512,
        "chunk_delay_s": 0.5,
    }
).encode()
_TCP_ESTABLISHED = 1


def _request(body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


class Readers:
    """``n`` clients that ask for an endless stream and never read, opened evenly over
    ``ramp_s`` (so that their drops, and their replacements, come evenly too, not in
    one wave); one the router dropped (its connection no longer established) is
    replaced at the next ``tend``."""

    def __init__(self, port: int, n: int, ramp_s: float) -> None:
        self.port = port
        self.n = n
        self.t0 = time.monotonic()
        self.ramp_s = ramp_s
        self.socks: list[socket.socket] = []
        self.replaced = 0

    def _open(self) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        # segments of an Ethernet path, not loopback's 64 KiB: the router's kernel send
        # buffer toward the reader then grows as it would toward a remote client
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1448)
        s.connect(("127.0.0.1", self.port))
        s.sendall(_request(_ENDLESS))
        return s

    def tend(self) -> None:
        due = self.n if self.ramp_s <= 0 else int(self.n * (time.monotonic() - self.t0) / self.ramp_s) + 1
        while len(self.socks) < min(due, self.n):
            self.socks.append(self._open())
        for i, s in enumerate(self.socks):
            state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            if state != _TCP_ESTABLISHED:
                s.close()
                self.socks[i] = self._open()
                self.replaced += 1

    def close(self) -> None:
        for s in self.socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()


async def _one(port: int) -> float:
    """One streamed completion on a fresh connection, read to its end; its TTFT."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.monotonic()
        writer.write(_request(_LEGIT))
        seen = b""
        ttft = None
        while True:
            data = await asyncio.wait_for(reader.read(1 << 16), 30.0)
            if not data:
                break
            seen += data
            if ttft is None and b'"text"' in seen:
                ttft = time.monotonic() - t0
        if not seen.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in seen or ttft is None:
            raise RuntimeError(f"a legitimate request failed: {seen[:200]!r}")
        return ttft
    finally:
        writer.close()


async def _phase(port: int, clients: int, seconds: float, pids: dict[str, int]) -> dict:
    cpu0 = {k: cpu_s(pid) for k, pid in pids.items()}
    ttfts: list[float] = []
    failed = 0
    end = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal failed
        while time.monotonic() < end:
            try:
                ttfts.append(await _one(port))
            except (RuntimeError, OSError, asyncio.TimeoutError):
                failed += 1

    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(clients)))
    wall = time.monotonic() - t0
    ttfts.sort()
    return {
        # CPU seconds per second of the phase: what the router (and the worker, on the
        # same machine here) spent, the readers' share included
        **{f"{k}_cpu": (cpu_s(pid) - cpu0[k]) / wall for k, pid in pids.items()},
        "requests": len(ttfts),
        "failed": failed,
        "rps": len(ttfts) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def _server_errors(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    pattern = r'^radixfleet_(?:requests|rejected)_total\{[^}]*status="5\d\d"[^}]*\} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def _readers_process(port: int, n: int, ramp_s: float) -> int:
    """``--readers-at PORT``: ``n`` readers opened over ``ramp_s``, replaced as they are
    dropped, until SIGTERM; prints how many were replaced. A process of its own, so
    that opening and tending them never takes the legitimate clients' interpreter."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    readers = Readers(port, n, ramp_s)
    readers.tend()
    print("ready", flush=True)
    while not stop.wait(0.1):
        readers.tend()
    readers.close()
    print(readers.replaced, flush=True)
    return 0


class Attack:
    """The readers' process (``_readers_process``) while an attack runs."""

    def __init__(self, port: int, n: int, ramp_s: float) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--readers-at",
                str(port),
                "--readers",
                str(n),
                "--ramp-s",
                str(ramp_s),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the readers' process did not start")

    def stop(self) -> int:
        """Ends the attack; how many readers were replaced."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return int(out.split()[-1])


class Watcher(threading.Thread):
    """Beside the load, in its own thread: samples the router's RSS every 0.5 s, and
    every 2 s whether the worker's breaker is open."""

    def __init__(self, r: RouterProcess) -> None:
        super().__init__(daemon=True)
        self.r = r
        self.rss = r.resources().rss_bytes
        self.breaker = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        n = 0
        while not self._done.wait(0.5):
            self.rss = max(self.rss, self.r.resources().rss_bytes)
            n += 1
            if n % 4 == 0:
                try:
                    self.breaker = max(self.breaker, _metric(self.r.base, "radixfleet_worker_breaker_state"))
                except httpx.HTTPError:
                    pass  # sampled again in 2 s

    def stop(self) -> None:
        self._done.set()
        self.join()


async def _run(r: RouterProcess, args: argparse.Namespace, pids: dict[str, int]) -> dict:
    await _phase(r.port, args.clients, 2.0, pids)  # warm-up, not counted
    watcher = Watcher(r)
    base_rss = watcher.rss
    watcher.start()
    out: dict = {"alone": [], "attacked": [], "replaced": 0}
    try:
        for _ in range(args.rounds):
            out["alone"].append(await _phase(r.port, args.clients, args.seconds, pids))
            attack = Attack(r.port, args.readers, args.ramp_s)
            try:
                await asyncio.sleep(args.settle_s)  # the readers' buffers fill
                out["attacked"].append(await _phase(r.port, args.clients, args.seconds, pids))
            finally:
                out["replaced"] += attack.stop()
            await asyncio.sleep(1.0)
    finally:
        watcher.stop()
    out["rss_base_mib"] = base_rss / 2**20
    out["rss_peak_mib"] = watcher.rss / 2**20
    out["breaker_opened"] = watcher.breaker > 0
    out["dropped"] = _metric(r.base, "radixfleet_slow_clients_dropped_total")
    out["answered_5xx"] = _server_errors(r.base)
    return out


def _summary(phases: list[dict]) -> dict:
    return {
        "rps": statistics.median(p["rps"] for p in phases),
        "ttft_p50_ms": statistics.median(p["ttft_p50_ms"] for p in phases),
        "ttft_p99_ms": statistics.median(p["ttft_p99_ms"] for p in phases),
        "failed": sum(p["failed"] for p in phases),
        "router_cpu": statistics.median(p["router_cpu"] for p in phases),
        # the router's CPU per legitimate request, the readers' share included: what
        # the machine's other load moves least
        "router_cpu_ms_per_request": statistics.median(1e3 * p["router_cpu"] / p["rps"] for p in phases),
        "worker_cpu": statistics.median(p["worker_cpu"] for p in phases),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=200, help="clients that never read")
    p.add_argument("--clients", type=int, default=16, help="legitimate closed-loop clients")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    p.add_argument(
        "--ramp-s",
        type=float,
        default=15.0,
        help="the readers are opened evenly over this (0: at once); keep it near timeouts.client_idle_s",
    )
    p.add_argument(
        "--settle-s", type=float, default=20.0, help="from opening the readers to measuring beside them"
    )
    p.add_argument("--rounds", type=int, default=3, help="(alone, attacked) pairs")
    p.add_argument(
        "--client-idle-s", type=float, default=None, help="timeouts.client_idle_s (default: the router's)"
    )
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--readers-at", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.readers_at is not None:
        return _readers_process(args.readers_at, args.readers, args.ramp_s)
    up_port = free_port()
    up = f"http://127.0.0.1:{up_port}"
    upstream = ["python3", "-m", "radixfleet_tools.bench.proxy", "upstream", "--port", str(up_port)]
    config = f"listen: {{host: 127.0.0.1, port: {{port}}}}\nworkers: [{{url: {up}, id: up}}]\n"
    if args.client_idle_s is not None:
        config += f"timeouts: {{client_idle_s: {args.client_idle_s}}}\n"
    with Proc(upstream, ready_url=f"{up}/health") as u, RouterProcess(config) as r:
        assert u.proc is not None
        out = asyncio.run(_run(r, args, {"router": r.pid, "worker": u.proc.pid}))
    alone, attacked = _summary(out["alone"]), _summary(out["attacked"])
    pairs = list(zip(out["alone"], out["attacked"], strict=True))
    out["rps_ratio"] = statistics.median(b["rps"] / a["rps"] for a, b in pairs)
    out["ttft_p99_ratio"] = statistics.median(b["ttft_p99_ms"] / a["ttft_p99_ms"] for a, b in pairs)
    doc = {"args": vars(args), "alone": alone, "attacked": attacked, **out}
    print(
        f"legitimate, alone:    {alone['rps']:.0f} req/s, TTFT p50 {alone['ttft_p50_ms']:.1f} ms, "
        f"p99 {alone['ttft_p99_ms']:.1f} ms, {alone['failed']} failed; "
        f"router CPU {alone['router_cpu']:.2f} ({alone['router_cpu_ms_per_request']:.3f} ms a request), "
        f"worker {alone['worker_cpu']:.2f}"
    )
    print(
        f"with {args.readers} readers: {attacked['rps']:.0f} req/s ({attacked['rps'] / alone['rps']:.1%}), "
        f"TTFT p50 {attacked['ttft_p50_ms']:.1f} ms, p99 {attacked['ttft_p99_ms']:.1f} ms "
        f"({attacked['ttft_p99_ms'] / alone['ttft_p99_ms']:.2f}x), {attacked['failed']} failed; "
        f"router CPU {attacked['router_cpu']:.2f} "
        f"({attacked['router_cpu_ms_per_request']:.3f} ms a request), "
        f"worker {attacked['worker_cpu']:.2f}"
    )
    print(
        f"per round, attacked / alone (median): throughput {out['rps_ratio']:.1%}, "
        f"p99 TTFT {out['ttft_p99_ratio']:.2f}x"
    )
    print(
        f"router RSS {out['rss_base_mib']:.0f} -> peak {out['rss_peak_mib']:.0f} MiB; "
        f"{out['dropped']:.0f} readers dropped ({out['replaced']} replaced); "
        f"breaker opened: {out['breaker_opened']}; answered >= 500: {out['answered_5xx']:.0f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
