"""DNS discovery against a real resolver: dnsmasq (Debian's package, installed by
the fixture when missing) on a loopback port, answering for ``pool.test`` from a
hosts file the test rewrites (SIGHUP re-reads it), like a headless Service's
records changing as pods come and go."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import pytest
from prometheus_client import CollectorRegistry

from radixfleet.config import parse_config
from radixfleet.fleet.discovery import Discovery
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint
from radixfleet.fleet.discovery.dns import DnsSource
from radixfleet.fleet.pool import Pool, Source
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet_tools.harness.procs import free_port
from tests.deploy_tools import apt_binary

pytestmark = pytest.mark.integration

NAME = "vllm.pool.test"


def free_udp_port() -> int:
    """A port free for both UDP and TCP on loopback (dnsmasq listens on both: a port
    free for UDP alone was once taken for TCP by another test's server)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


class _PortTaken(RuntimeError):
    pass


class Dnsmasq:
    """dnsmasq authoritative for ``pool.test`` on 127.0.0.1:port (UDP and TCP)."""

    def __init__(self, binary: str, folder) -> None:
        self.binary = binary
        self.hosts = folder / "hosts"
        self.hosts.write_text("")
        self.port = free_udp_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Dnsmasq:
        for _ in range(5):
            try:
                return self._start()
            except _PortTaken:
                # taken between our check and dnsmasq's bind: another port
                self.port = free_udp_port()
        return self._start()

    def _start(self) -> Dnsmasq:
        argv = [
            self.binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            f"--addn-hosts={self.hosts}",
            "--local=/pool.test/",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--port={self.port}",
            "--pid-file",
            "--log-facility=-",
            "--cache-size=0",
        ]
        if os.geteuid() == 0:
            argv.append("--user=root")  # read the hosts file inside pytest's 0700 tmp dir
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode()
                if "Address already in use" in out:
                    raise _PortTaken(out)
                raise RuntimeError(f"dnsmasq exited: {out}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("dnsmasq did not listen")

    def set_records(self, addrs: list[str], name: str = NAME) -> None:
        self.hosts.write_text("".join(f"{a} {name}\n" for a in addrs))
        self.proc.send_signal(signal.SIGHUP)  # re-read the hosts files
        time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="session")
def dnsmasq_binary() -> str:
    return apt_binary("dnsmasq", "dnsmasq-base")


@pytest.fixture
def dnsmasq(dnsmasq_binary, tmp_path):
    d = Dnsmasq(dnsmasq_binary, tmp_path).start()
    yield d
    d.stop()


def dns_cfg(nameserver: str, **extra):
    disc = {
        "backoff_s": 0.05,
        "backoff_max_s": 0.2,
        "dns": {
            "nameserver": nameserver,
            "interval_s": 0.1,
            "timeout_s": 0.5,
            "services": [{"name": NAME, "port": 8123, "kind": "vllm"}],
        },
    }
    disc.update(extra)
    return parse_config({"workers": {"discovery": disc}})


def pool_for(cfg) -> Pool:
    return Pool(cfg, PrefixIndex(1 << 20, 30.0))  # not started: no health checks


async def until(pred, timeout_s=5.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def discovered(pool: Pool) -> dict[str, str]:
    return {w.id: w.url for w in pool if w.source is Source.DISCOVERY}


async def test_a_and_aaaa_records_become_workers_and_follow_changes(dnsmasq):
    dnsmasq.set_records(["127.0.0.2", "127.0.0.3", "::1"])
    cfg = dns_cfg(f"127.0.0.1:{dnsmasq.port}")
    src = DnsSource(cfg.discovery.dns, DiscoveryMetrics(CollectorRegistry()))
    gen = src.snapshots()
    first = await asyncio.wait_for(gen.__anext__(), 5)
    assert first == {
        Endpoint("127.0.0.2:8123", "http://127.0.0.2:8123", "vllm"),
        Endpoint("127.0.0.3:8123", "http://127.0.0.3:8123", "vllm"),
        Endpoint("[::1]:8123", "http://[::1]:8123", "vllm"),
    }
    dnsmasq.set_records(["127.0.0.3", "127.0.0.4"])  # a pod left, one came
    t0 = time.monotonic()
    second = await asyncio.wait_for(gen.__anext__(), 5)
    took = time.monotonic() - t0
    assert {e.id for e in second} == {"127.0.0.3:8123", "127.0.0.4:8123"}
    assert took < 1.0, f"re-resolution took {took:.2f}s with interval_s 0.1"
    dnsmasq.set_records([])  # NXDOMAIN: an answer, no workers
    assert await asyncio.wait_for(gen.__anext__(), 5) == frozenset()
    await gen.aclose()


async def test_router_routes_to_agents_found_in_dns(dnsmasq, tmp_path):
    """Two real agents on 127.0.0.2 and 127.0.0.3 (same port), found through DNS by a
    real router, serve a completion; removing a record removes the worker."""
    import httpx

    from radixfleet.server.app import Router, RouterServer
    from radixfleet_tools.harness.procs import Proc, radixfleet_argv

    ap = free_port()
    agents = [
        Proc(
            radixfleet_argv("agent", "--host", h, "--port", str(ap), "--kv-tokens", "50000"),
            ready_url=f"http://{h}:{ap}/health",
            timeout_s=30,
        )
        for h in ("127.0.0.2", "127.0.0.3")
    ]
    dnsmasq.set_records(["127.0.0.2", "127.0.0.3"])
    cfg = parse_config(
        {
            "listen": {"port": 0},
            "health": {"interval_s": 0.2},
            "response_headers": {"worker_id": True},
            "workers": {
                "discovery": {
                    "dns": {
                        "nameserver": f"127.0.0.1:{dnsmasq.port}",
                        "interval_s": 0.2,
                        "services": [{"name": NAME, "port": ap, "kind": "agent"}],
                    }
                }
            },
        }
    )
    try:
        for a in agents:
            a.__enter__()
        router = Router(cfg)
        async with RouterServer(router, port=0, admin_port=0) as srv:
            await until(
                lambda: len(router.pool.routable_workers(time.monotonic())) == 2, 10, "both agents routable"
            )
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as c:
                r = await c.post(
                    "/v1/completions", json={"model": "llama-3-8b", "prompt": "hello " * 40, "max_tokens": 4}
                )
                assert r.status_code == 200, r.text
                assert r.headers["x-radixfleet-worker"] in {f"127.0.0.2:{ap}", f"127.0.0.3:{ap}"}
                dnsmasq.set_records(["127.0.0.3"])
                await until(
                    lambda: set(discovered(router.pool)) == {f"127.0.0.3:{ap}"},
                    5,
                    "the removed record to leave the pool",
                )
                metrics = (await c.get(f"http://127.0.0.1:{srv.admin_port}/metrics")).text
                assert 'radixfleet_discovery_changes_total{op="removed"} 1.0' in metrics
    finally:
        for a in agents:
            a.stop()


async def test_unreachable_or_garbage_resolver_keeps_what_was_known(dnsmasq):
    dnsmasq.set_records(["127.0.0.2", "127.0.0.3"])
    cfg = dns_cfg(f"127.0.0.1:{dnsmasq.port}")
    pool = pool_for(cfg)
    registry = CollectorRegistry()
    async with Discovery(cfg.discovery, pool, registry) as disc:
        await until(lambda: len(discovered(pool)) == 2, what="first answer")
        before = discovered(pool)
        dnsmasq.stop()  # the resolver goes away
        await until(
            lambda: (
                (
                    registry.get_sample_value(
                        "radixfleet_discovery_errors_total", {"source": "dns", "cause": "timeout"}
                    )
                    or 0
                )
                + (
                    registry.get_sample_value(
                        "radixfleet_discovery_errors_total", {"source": "dns", "cause": "servfail"}
                    )
                    or 0
                )
                >= 2
            ),
            10,
            "errors counted",
        )
        assert discovered(pool) == before
        disc.reconciler.check()

    # A "resolver" that answers every query with garbage bytes.
    loop = asyncio.get_running_loop()

    class Garbage(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.transport = transport

        def datagram_received(self, data, addr):
            self.transport.sendto(data[:2] + b"\x81\x80\xff\xff garbage \x00\x01" * 3, addr)

    transport, _ = await loop.create_datagram_endpoint(Garbage, local_addr=("127.0.0.1", 0))
    try:
        gport = transport.get_extra_info("sockname")[1]
        cfg2 = dns_cfg(f"127.0.0.1:{gport}")
        registry2 = CollectorRegistry()
        pool2 = pool_for(cfg2)
        pool2.add("static", "http://127.0.0.9:1", Source.CONFIG)
        async with Discovery(cfg2.discovery, pool2, registry2):
            await until(
                lambda: (
                    sum(
                        s.value
                        for m in registry2.collect()
                        if m.name == "radixfleet_discovery_errors"
                        for s in m.samples
                        if s.name.endswith("_total")
                    )
                    >= 3
                ),
                10,
                "garbage counted",
            )
            assert [w.id for w in pool2] == ["static"]  # nothing invented, nothing lost
    finally:
        transport.close()


async def test_thousands_of_records_are_capped_logged_and_counted(dnsmasq, caplog):
    addrs = [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(3000)]
    dnsmasq.set_records(addrs)
    cfg = dns_cfg(f"127.0.0.1:{dnsmasq.port}", max_workers=2500)
    pool = pool_for(cfg)
    registry = CollectorRegistry()
    async with Discovery(cfg.discovery, pool, registry) as disc:
        await until(lambda: len(discovered(pool)) == 2500, 20, "2500 workers")
        disc.reconciler.check()
        pool.check()
        assert registry.get_sample_value("radixfleet_discovery_endpoints", {"source": "dns"}) == 3000
        assert (
            registry.get_sample_value(
                "radixfleet_discovery_errors_total", {"source": "reconcile", "cause": "too_many"}
            )
            >= 1
        )
    warned = [r for r in caplog.records if "max_workers" in r.getMessage()]
    assert len(warned) == 1  # logged once, however many answers repeated it
