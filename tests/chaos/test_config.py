"""Configuration attacks on a live router process: an alias bomb written over its
watched file is refused while the router keeps answering (the reload is prepared
off the event loop, the document bounded while it is read); the watched file
truncated and rewritten in pieces never turns client authentication off (an empty
file is refused, a partial one that drops the API keys is a security downgrade,
refused; only the whole file applies, once); and an events endpoint the engine
already binds stops the router at start with one line saying what to write — no ZMQ
"Address already in use" traceback."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from radixfleet_tools.harness.router_process import RouterProcess
from tests.config.yaml_bombs import alias_bomb
from tests.router.serve import upstream_proc

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


SECURED_HEAD = (
    "listen: {{host: 127.0.0.1, port: {port}}}\n"
    "workers: [{{url: '{url}', id: u}}]\n"
    "policy: {{name: {policy}}}\n"
    "health: {{interval_s: 0.1, timeout_s: 0.5, failure_threshold: 1, success_threshold: 1}}\n"
    "reload: {{watch: true, poll_interval_s: 0.1}}\n"
)
SECURED_TAIL = (
    "keys:\n"
    "  tenant:\n"
    "    source: api_key\n"
    "    api_keys: [{tenant: acme, key: sk-acme, name: ka}]\n"
    "tenancy:\n"
    "  tenants: {acme: {requests_per_s: 1000}}\n"
)


def test_a_watched_file_truncated_and_rewritten_never_turns_authentication_off():
    """``: > router.yaml`` (what ``cat >``, ``envsubst >`` and ``open(path, "w")`` do
    first) must never apply as an all-defaults config (no API key needed, tenants
    and limits gone). Here the file is truncated, then written in two pieces, each
    state held for several polls: the empty file and the keyless first piece are
    refused at ERROR, a request without a key is never served, and the whole file is
    applied once."""
    pu, url = upstream_proc("u")
    with (
        pu,
        RouterProcess(
            config=SECURED_HEAD.format(port="{port}", url=url, policy="round_robin") + SECURED_TAIL
        ) as r,
    ):
        path = Path(r.log_path).parent / "router.yaml"
        keyless: list[int] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=5) as c:
                while not stop.is_set():
                    resp = c.post(f"{r.base}/v1/completions", json={"model": "m", "prompt": "hi"})
                    keyless.append(resp.status_code)
                    time.sleep(0.01)

        def until(text: str) -> None:
            deadline = time.monotonic() + 20
            while text not in r.output():
                # any answer but 401 means the key was no longer checked (on main: the
                # empty file applied, 503 with its workers gone too, or 200 with them)
                assert set(keyless) <= {401}, (sorted(set(keyless)), r.output()[-2000:])
                assert time.monotonic() < deadline, f"no {text!r} in {r.output()[-2000:]}"
                time.sleep(0.02)

        deadline = time.monotonic() + 10
        with httpx.Client(timeout=5) as c:
            while c.get(f"{r.base}/readiness").status_code != 200:
                assert time.monotonic() < deadline, r.output()[-2000:]
                time.sleep(0.05)
        t = threading.Thread(target=probe, daemon=True)
        t.start()
        try:
            with open(path, "w") as f:  # truncated: what `cat > router.yaml` does first
                f.flush()
                until("holds no settings")
                f.write(SECURED_HEAD.format(port=r.port, url=url, policy="least_load"))
                f.flush()  # the first piece: a valid file without the API keys
                until("lowers security")
                f.write(SECURED_TAIL)
            until("config reloaded")
            time.sleep(0.5)  # several more polls: the applied file is not applied again
        finally:
            stop.set()
            t.join(10)
        assert keyless and set(keyless) == {401}, sorted(set(keyless))
        out = r.output()
        assert out.count("config reloaded") == 1, out[-3000:]
        assert "policy least_load" in out and "tenant source api_key" in out, out[-3000:]
        with httpx.Client(timeout=5) as c:
            ok = c.post(
                f"{r.base}/v1/completions",
                json={"model": "m", "prompt": "hi"},
                headers={"Authorization": "Bearer sk-acme"},
            )
            assert ok.status_code == 200, ok.text
            metrics = c.get(f"{r.admin}/metrics").text
        assert 'radixfleet_config_reload_failures_total{reason="empty"} 1.0' in metrics, metrics
        assert 'radixfleet_config_reload_failures_total{reason="downgrade"} 1.0' in metrics, metrics
        assert "radixfleet_config_reloads_total 1.0" in metrics
    r.assert_no_tracebacks()


def test_an_events_endpoint_the_engine_binds_stops_the_router_with_what_to_write(tmp_path):
    engine = socket.socket()
    engine.bind(("0.0.0.0", 0))
    engine.listen()
    port = engine.getsockname()[1]
    tok = tmp_path / "tok"
    from radixfleet_tools.bench.tiny_tokenizer import build

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
