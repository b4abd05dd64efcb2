"""The proxy benchmark's lean ends (radixfleet_tools.bench.wire): the upstream writes each
SSE event separately and the client counts every event that arrives — through the
radixfleet proxy too — so the benchmark's chunks/s are counted, not computed."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.bench.wire import LeanClient, LeanUpstream, post_request
from radixfleet_tools.harness.procs import free_port

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 1}


class _Writes(asyncio.Protocol):
    """Records every read of a raw connection (to see separate writes arrive)."""

    def __init__(self) -> None:
        self.reads: list[bytes] = []
        self.done = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.reads.append(data)
        if data.endswith(b"0\r\n\r\n") and not self.done.done():
            self.done.set_result(None)


@pytest.mark.integration
async def test_lean_upstream_streams_every_event_as_its_own_write_and_the_client_counts_them():
    up = LeanUpstream(chunks=40)
    port = await up.start(0)
    try:
        c = await LeanClient.connect("127.0.0.1", port)
        try:
            a = await c.request(post_request("127.0.0.1", port, "/v1/completions", dict(BODY, stream=True)))
            assert a.status == 200 and a.done and a.events == 41  # 40 + [DONE]
            b = await c.request(post_request("127.0.0.1", port, "/v1/completions", BODY))
            assert b.status == 200 and b.events == 0 and not b.done and b.latency_s > 0
        finally:
            c.close()
        assert up.requests == 2 and up.streams == 1 and up.chunks_sent == 40
        # on the wire: one write per event, each its own loop turn; a reader that keeps
        # up sees many separate reads, not one blob
        loop = asyncio.get_running_loop()
        tr, proto = await loop.create_connection(_Writes, "127.0.0.1", port)
        tr.write(post_request("127.0.0.1", port, "/v1/completions", dict(BODY, stream=True)))
        await asyncio.wait_for(proto.done, 10)
        tr.close()
        assert len(proto.reads) > 10, len(proto.reads)
        assert b"".join(proto.reads).count(b"data: ") == 41
    finally:
        await up.close()


def test_client_counts_events_split_across_reads():
    from radixfleet_tools.bench.wire import _Answer

    c = LeanClient()
    stream = b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
    for cut in range(1, len(stream)):
        c._ans = _Answer()
        c._last = c._tail = b""
        c.on_body(stream[:cut])
        c.on_body(stream[cut:])
        assert c._ans.events == 3, cut
        assert c._tail == b"data: [DONE]\n\n"


@pytest.mark.integration
async def test_events_counted_through_the_radixfleet_proxy():
    up = LeanUpstream(chunks=64)
    up_port = await up.start(0)
    router = Router(
        parse_config(
            {
                "workers": [{"url": f"http://127.0.0.1:{up_port}", "id": "u"}],
                "health": {
                    "interval_s": 0.1,
                    "timeout_s": 0.5,
                    "failure_threshold": 1,
                    "success_threshold": 1,
                },
                "policy": {"name": "round_robin"},
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    try:
        deadline = time.monotonic() + 5
        while not router.pool.views(time.monotonic()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        c = await LeanClient.connect("127.0.0.1", port)
        try:
            for _ in range(3):
                a = await c.request(
                    post_request("127.0.0.1", port, "/v1/completions", dict(BODY, stream=True))
                )
                assert a.status == 200 and a.done and a.events == 65
        finally:
            c.close()
        assert up.chunks_sent == 3 * 64
    finally:
        await server.aclose()
        await up.close()
