"""One request's path through the router, in-process: its CPU, its profile, its walk.

    python3 bench/request_walk.py cpu     [--requests 2000] [--stream]
    python3 bench/request_walk.py profile [--requests 2000] [--stream] [--top 40]
    python3 bench/request_walk.py walk    [--stream]
    python3 bench/request_walk.py opcodes [--stream] [--top 40]

A router (the raw front, ``round_robin``, one static worker: what ``radixfleet bench
proxy`` runs) in front of the proxy benchmark's aiohttp upstream
(``radixfleet_tools.bench.proxy.upstream_app``), both in this process on loopback, and a
client on one keep-alive connection sending ``--requests`` completions (the proxy
benchmark's body) one at a time.

``cpu`` prints this process's CPU per request (client, upstream and router together:
compare two checkouts by running this file's copy from each, alternately, since the
host is shared; only the router's code differs between them). ``profile`` prints
cProfile's functions of ``radixfleet/server/`` by own time per request. ``opcodes`` counts the
Python bytecodes executed per request (``sys.settrace``'s opcode events), in all and
per file of ``radixfleet/server/``: deterministic, so two checkouts compare on a busy host,
though it does not weigh C code (parsers, the event loop). ``walk`` traces one
request (after warm-up ones) with ``sys.setprofile`` from ``DataPlane.serve`` down
(the calls made inside it):
the *rooms* it visits are the router's objects and modules (a method's room is its
class, a function's its module; the client's, the upstream's and the library's code
are not rooms) and the walk is the sequence of rooms entered; a *return* is entering
a room visited earlier in the walk but not the one just left (the request coming back
to an object it already went through). Prints stops (room changes), returns, and the
returns per room.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

REPO = Path(os.environ.get("WALK_REPO", Path(__file__).resolve().parents[1])).resolve()
sys.path.insert(0, str(REPO))

from aiohttp import web  # noqa: E402

from radixfleet.config import parse_config  # noqa: E402
from radixfleet.server.app import Router, RouterServer  # noqa: E402
from radixfleet_tools.bench.proxy import upstream_app  # noqa: E402
from radixfleet_tools.harness.procs import free_port  # noqa: E402

BODY = {"model": "tiny", "prompt": "hello world, a short benchmark prompt", "max_tokens": 1}
ROUTER = str(REPO / "router") + os.sep
ROOMS = "module"  # --rooms


async def _fleet():
    runner = web.AppRunner(upstream_app("up", model="tiny"), access_log=None)
    await runner.setup()
    up_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()
    router = Router(
        parse_config({"workers": [{"url": f"http://127.0.0.1:{up_port}"}], "policy": {"name": "round_robin"}})
    )
    server = RouterServer(router, port=free_port())
    port = await server.start()
    deadline = time.monotonic() + 10
    while not router.pool.views(time.monotonic()):
        assert time.monotonic() < deadline, "the worker never turned routable"
        await asyncio.sleep(0.05)
    return runner, server, port


async def _send(reader, writer, payload: bytes) -> None:
    writer.write(payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        while True:
            size = int((await reader.readline()).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(n)


def _payload(stream: bool) -> bytes:
    import json

    body = json.dumps({**BODY, "stream": stream}).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


def _room(frame) -> str | None:
    code = frame.f_code
    fn = code.co_filename
    if not fn.startswith(ROUTER):
        return None
    mod = "router." + fn[len(ROUTER) :].removesuffix(".py").replace(os.sep, ".")
    owner = frame.f_locals.get("self") if ROOMS == "class" and code.co_varnames[:1] == ("self",) else None
    if owner is not None:
        return f"{mod}.{type(owner).__name__}"
    return mod


def returns(walk: list[str], start: int = 0) -> collections.Counter:
    """Per room, how often the walk (its rooms in the order entered, no room twice in
    a row) comes back to it at a stop from ``start`` on, having been there before."""
    back: collections.Counter = collections.Counter()
    seen: set[str] = set()
    for i, r in enumerate(walk):
        if r in seen and i >= start:
            back[r] += 1
        seen.add(r)
    return back


def _under_serve(frame) -> bool:
    """Whether ``frame`` runs inside ``DataPlane.serve`` (the walk's span)."""
    f = frame
    while f is not None:
        c = f.f_code
        if c.co_name == "serve" and c.co_filename.endswith(os.sep + "dataplane.py"):
            return True
        f = f.f_back
    return False


async def _main(args) -> None:
    runner, server, port = await _fleet()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = _payload(args.stream)
    try:
        for _ in range(50):  # warm: connections, caches
            await _send(reader, writer, payload)
        if args.mode == "walk":
            walk: list[str] = []
            names: list[str] = []
            picked: list[int] = []  # the stop where its pick is told or forwarded

            def prof(frame, event, arg):
                if event == "call" and _under_serve(frame):
                    r = _room(frame)
                    if r is not None and (not walk or walk[-1] != r):
                        walk.append(r)
                        names.append(frame.f_code.co_name)
                    if r is not None and not picked and frame.f_code.co_name in ("routed", "forward"):
                        picked.append(len(walk) - 1)

            sys.setprofile(prof)
            await _send(reader, writer, payload)
            sys.setprofile(None)
            back = returns(walk)
            after = sum(returns(walk, picked[0]).values())
            print(f"stops {len(walk)} returns {sum(back.values())} rooms {len(set(walk))}")
            print(f"after the pick (from routed or forward): stops {len(walk) - picked[0]} returns {after}")
            for r, n in back.most_common():
                print(f"  {n:3d}  {r}")
            if args.verbose:
                print(" -> ".join(f"{r}.{n}" for r, n in zip(walk, names, strict=True)))
            return
        if args.mode == "opcodes":
            ops: collections.Counter = collections.Counter()

            def local(frame, event, arg):
                if event == "opcode":
                    c = frame.f_code
                    ops[(c.co_filename, c.co_name) if args.functions else (c.co_filename, "")] += 1
                return local

            def glob(frame, event, arg):
                frame.f_trace_opcodes = True
                return local

            n = min(args.requests, 200)
            sys.settrace(glob)
            for _ in range(n):
                await _send(reader, writer, payload)
            sys.settrace(None)
            ours = {
                f"{f[len(ROUTER) :]}:{name}".rstrip(":"): c
                for (f, name), c in ops.items()
                if f.startswith(ROUTER)
            }
            print(f"opcodes/request: all {sum(ops.values()) / n:.0f}, router {sum(ours.values()) / n:.0f}")
            for f, c in sorted(ours.items(), key=lambda x: -x[1])[: args.top]:
                print(f"  {c / n:7.0f}  {f}")
            return
        prof = cProfile.Profile() if args.mode == "profile" else None
        c0 = time.process_time()
        if prof is not None:
            prof.enable()
        for _ in range(args.requests):
            await _send(reader, writer, payload)
        if prof is not None:
            prof.disable()
        cpu = time.process_time() - c0
        print(f"cpu_us_per_request {cpu / args.requests * 1e6:.1f}")
        if prof is not None:
            st = pstats.Stats(prof)
            rows = []
            for (fn, line, name), (_cc, nc, tt, ct, _) in st.stats.items():
                if fn.startswith(ROUTER):
                    rows.append((tt, ct, nc, f"{fn[len(ROUTER) :]}:{line}:{name}"))
            rows.sort(reverse=True)
            tot = sum(r[0] for r in rows)
            calls = sum(nc for (_, _, _), (_, nc, _, _, _) in st.stats.items())
            ours = sum(r[2] for r in rows)
            n = args.requests
            print(f"router own time us/request {tot / n * 1e6:.1f}; share of all {tot / st.total_tt:.3f}")
            print(f"calls/request: all {calls / n:.1f}, router {ours / n:.1f}")
            if args.dump:
                import json

                Path(args.dump).write_text(
                    json.dumps(
                        {
                            w.rsplit(":", 2)[0] + ":" + w.rsplit(":", 1)[1]: [t / tot, c / n]
                            for t, _, c, w in rows
                        }
                    )
                )
            for tt, ct, nc, where in rows[: args.top]:
                n = args.requests
                print(f"{tt / n * 1e6:8.2f} {ct / n * 1e6:8.2f} {nc / n:6.2f}  {where}")
    finally:
        writer.close()
        await server.aclose()
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("cpu", "profile", "walk", "opcodes"))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--functions", action="store_true", help="opcodes: per function, not per file")
    p.add_argument("--dump", help="profile: write {function: [share of router time, calls/request]}")
    p.add_argument("--rooms", choices=("module", "class"), default="class")
    args = p.parse_args()
    global ROOMS
    ROOMS = args.rooms
    args.requests = max(1, min(args.requests, 20000))
    import logging

    logging.disable(logging.WARNING)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
