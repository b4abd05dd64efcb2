"""Configuration attacks on a live router process: an alias bomb written over its
watched file is refused while the router keeps answering (the reload is prepared
off the event loop, the document bounded while it is read), and an events endpoint
the engine already binds stops the router at start with one line saying what to
write — no ZMQ "Address already in use" traceback."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.chaos.harness import RouterProcess
from tests.config.yaml_bombs import alias_bomb

pytestmark = pytest.mark.integration

CONFIG = (
    "listen: {host: 127.0.0.1, port: {port}}\n"
    "workers: ['http://127.0.0.1:9']\n"
    "policy: {name: round_robin}\n"
    "reload: {watch: true, poll_interval_s: 0.2}\n"
)


def test_an_alias_bomb_over_the_watched_file_is_refused_while_the_router_answers():
    with RouterProcess(config=CONFIG) as r:
        base = r.resources()
        path = Path(r.log_path).parent / "router.yaml"
        path.write_text(alias_bomb(9))
        worst = 0.0
        deadline = time.monotonic() + 30
        while "config reload of" not in r.output():
            assert time.monotonic() < deadline, r.output()[-2000:]
            t0 = time.monotonic()
            assert httpx.get(f"{r.base}/health", timeout=10).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
        out = r.output()
        assert "refused, keeping the running config" in out and "alias bomb" in out, out
        assert worst < 1.0, worst  # before: the loop froze for the whole expansion
        r.assert_settles(base)
    r.assert_no_tracebacks()


def test_an_events_endpoint_the_engine_binds_stops_the_router_with_what_to_write(tmp_path):
    engine = socket.socket()
    engine.bind(("0.0.0.0", 0))
    engine.listen()
    port = engine.getsockname()[1]
    tok = tmp_path / "tok"
    from radixfleet.bench.tiny_tokenizer import build

    build(str(tok))
    try:
        with pytest.raises(RuntimeError) as ei:
            with RouterProcess(
                config=(
                    "listen: {host: 127.0.0.1, port: {port}}\n"
                    f"workers: [{{url: 'http://127.0.0.1:9', kind: vllm, tokenizer: '{tok}', "
                    f"events: {{endpoint: 'tcp://127.0.0.1:{port}'}}}}]\n"
                ),
                timeout_s=60,
            ):
                pass
    finally:
        engine.close()
    out = str(ei.value)
    assert "router exited with 2" in out, out
    assert "Traceback" not in out and "Address already in use" not in out, out
    assert f"workers[0].events.endpoint: tcp://127.0.0.1:{port} is a concrete host" in out
    assert f"Write tcp://*:{port} here" in out
