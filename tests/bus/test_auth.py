"""The bus behind NATS credentials and TLS, against a real nats-server on loopback.

A router replica (in-process) and a ``radixfleet agent`` process authenticate to a
server that requires it (user and password, an NKey, a token; TLS with a client
certificate) and sign their messages with the agent token; a client that holds a
NATS credential but not the agent token cannot register a worker. A wrong or
missing credential is one clear line (a log line, or exit 2 before starting),
never a traceback, and never shows the secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import time

import httpx
import nats
import nkeys
import pytest
import yaml

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet.wire.bus_wire import Subjects
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from tests.bus.client import bounded, chat, metric, tenant_load, wait_for
from tests.nats_server import NatsServer, make_certs, operator_mode

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("bus_salt")]

AGENT_TOKEN = "agent-token-for-the-bus-tests"
ROUTER_PASSWORD = "router-password-9f2"


#: a tenant limited to 10 requests/s (burst 10), named by the x-tenant-id header
ACME = {
    "keys": {"tenant": {"source": "header"}},
    "tenancy": {"tenants": {"acme": {"requests_per_s": 10, "request_burst": 10}}},
}


def bus_router(url: str, extra: dict | None = None, **bus) -> Router:
    return Router(
        parse_config(
            {
                **(extra or {}),
                "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2},
                "bus": {
                    "url": url,
                    "replica_id": "ra",
                    "heartbeat_s": 0.2,
                    "replica_ttl_s": 1.0,
                    "backoff_s": 0.1,
                    "backoff_max_s": 0.5,
                    **bus,
                },
            }
        )
    )


async def start(router: Router) -> tuple[RouterServer, str]:
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    return server, f"http://127.0.0.1:{port}"


def nkey_user(folder) -> tuple[str, str]:
    """(public key, seed file) of a fresh NKey user."""
    import os

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    path = folder / "agent.nk"
    path.write_bytes(seed + b"\n")
    return public, str(path)


def agent_proc(bus_url: str, *flags: str) -> Proc:
    port = free_port()
    return Proc(
        radixfleet_argv(
            "agent",
            "--port",
            str(port),
            "--worker-id",
            "ag0",
            "--bus",
            bus_url,
            "--kv-tokens",
            "400000",
            *flags,
        ),
        ready_url=f"http://127.0.0.1:{port}/health",
        timeout_s=30,
        env={"RADIXFLEET_AGENT_TOKEN": AGENT_TOKEN},
    )


@bounded()
async def test_router_and_agent_authenticate_sign_and_keep_out_who_lacks_the_token(tmp_path, monkeypatch):
    public, seed_file = nkey_user(tmp_path)
    conf = f"""authorization {{
  users = [
    {{user: router, password: "{ROUTER_PASSWORD}"}}
    {{nkey: "{public}"}}
  ]
}}
"""
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", AGENT_TOKEN)
    monkeypatch.setenv("TEST_BUS_PASSWORD", ROUTER_PASSWORD)
    with NatsServer(free_port(), config=conf) as ns:
        a = bus_router(ns.url, auth={"user": "router", "password_env": "TEST_BUS_PASSWORD"})
        sa, ua = await start(a)
        p = agent_proc(ns.url, "--bus-nkey-seed-file", seed_file).__enter__()
        nc = await nats.connect(ns.url, user="router", password=ROUTER_PASSWORD)
        try:
            await wait_for(lambda: a.bus.conn.up, 10, "router on the bus")
            await wait_for(lambda: a.pool.get("ag0") is not None, 20, "agent registered")
            await wait_for(
                lambda: "ag0" in [v.id for v in a.pool.views(time.monotonic())], 20, "agent healthy"
            )
            async with httpx.AsyncClient(timeout=30) as c:
                r = await chat(c, ua, "hello over an authenticated bus")
                assert r.status_code == 200, r.text
            await wait_for(lambda: "ag0" in a.index.workers(), 10, "signed events applied")
            # a NATS user without the agent token: its registration is dropped
            subj = Subjects("radixfleet").agent("busevil")
            await nc.jetstream().publish(
                subj,
                json.dumps(
                    {
                        "v": 1,
                        "kind": "agent",
                        "register": {"models": ["llama-3-8b"]},
                        "batch": {
                            "worker_id": "busevil",
                            "url": "http://127.0.0.1:9",
                            "epoch": "e",
                            "seq": 0,
                            "events": [{"type": "snapshot", "blocks": []}],
                        },
                    }
                ).encode(),
            )
            await wait_for(
                lambda: metric(a, "radixfleet_bus_bad_messages_total", cause="unsigned") >= 1,
                5,
                "unsigned dropped",
            )
            assert a.pool.get("busevil") is None
            assert metric(a, "radixfleet_bus_bad_messages_total", cause="bad_signature") == 0
        finally:
            await nc.close()
            p.__exit__(None, None, None)
            await sa.aclose()


@bounded()
async def test_creds_files_in_operator_mode(tmp_path, monkeypatch):
    """NATS's JWT authentication (what nsc sets up): router and agent with a .creds
    file, the stream created in a JetStream-enabled account, signed batches applied."""
    conf, creds = operator_mode(tmp_path)
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", AGENT_TOKEN)
    with NatsServer(free_port(), config=conf) as ns:
        a = bus_router(ns.url, auth={"creds_file": creds})
        sa, _ = await start(a)
        p = agent_proc(ns.url, "--bus-creds-file", creds).__enter__()
        try:
            await wait_for(lambda: a.bus.conn.up and a.bus.caught_up, 10, "router with creds")
            await wait_for(
                lambda: a.pool.get("ag0") is not None and a.pool.get("ag0").epoch is not None,
                20,
                "agent with creds",
            )
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()


@bounded()
async def test_a_refused_credential_is_one_error_line_and_the_router_serves_on(tmp_path, caplog):
    wrong = tmp_path / "password"
    wrong.write_text("not-the-password\n")
    conf = f'authorization {{ users = [ {{user: router, password: "{ROUTER_PASSWORD}"}} ] }}\n'
    caplog.set_level(logging.INFO)
    with NatsServer(free_port(), config=conf) as ns:
        a = bus_router(ns.url, auth={"user": "router", "password_file": str(wrong)})
        sa, ua = await start(a)
        try:
            await wait_for(
                lambda: metric(a, "radixfleet_bus_outages_total", cause="auth") >= 3,
                15,
                "refused credentials counted",
            )
            async with httpx.AsyncClient(timeout=5) as c:
                r = await c.get(ua + "/readiness")
                assert r.json()["bus"]["state"] != "up"
                assert (await c.get(ua + "/health")).status_code == 200
        finally:
            await sa.aclose()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "refused this side's credentials" in errors[0].getMessage()
    assert errors[0].exc_info is None
    assert "not-the-password" not in caplog.text and ROUTER_PASSWORD not in caplog.text
    assert "Traceback" not in caplog.text


@bounded()
async def test_token_authentication(tmp_path):
    token = tmp_path / "token"
    token.write_text("server-token-77\n")
    with NatsServer(free_port(), config='authorization { token: "server-token-77" }\n') as ns:
        a = bus_router(ns.url, auth={"token_file": str(token)})
        sa, _ = await start(a)
        try:
            await wait_for(lambda: a.bus.conn.up and a.bus.caught_up, 10, "up with a token")
        finally:
            await sa.aclose()


@bounded()
async def test_mutual_tls_and_an_unknown_server_certificate(tmp_path, caplog):
    certs = make_certs(tmp_path)
    conf = f"""tls {{
  cert_file: "{certs["server_cert"]}"
  key_file: "{certs["server_key"]}"
  ca_file: "{certs["ca"]}"
  verify: true
}}
"""
    with NatsServer(free_port(), config=conf) as ns:
        assert ns.url.startswith("tls://")
        good = bus_router(
            ns.url,
            tls={"ca_file": certs["ca"], "cert_file": certs["client_cert"], "key_file": certs["client_key"]},
        )
        sg, _ = await start(good)
        other = bus_router(
            ns.url,
            replica_id="rb",
            tls={
                "ca_file": certs["other_ca"],
                "cert_file": certs["client_cert"],
                "key_file": certs["client_key"],
            },
        )
        so, _ = await start(other)
        try:
            await wait_for(lambda: good.bus.conn.up and good.bus.caught_up, 10, "up over TLS")
            await wait_for(
                lambda: metric(other, "radixfleet_bus_outages_total", cause="tls") >= 1,
                10,
                "TLS failure counted",
            )
            assert not other.bus.conn.up
        finally:
            await so.aclose()
            await sg.aclose()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "TLS handshake failed" in lines[0], lines
    assert "Traceback" not in caplog.text


def test_missing_secrets_and_files_are_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"bus:\n  url: tls://127.0.0.1:4222\n  auth:\n    creds_file: {tmp_path / 'nope.creds'}\n")
    r = subprocess.run(radixfleet_argv("check-config", str(cfg)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "bus.auth.creds_file: no such file" in err, err
    cfg.write_text(
        "bus:\n  url: nats://127.0.0.1:4222\n  auth:\n    user: router\n"
        "    password_env: TEST_BUS_PASSWORD_UNSET\n"
    )
    r = subprocess.run(radixfleet_argv("check-config", str(cfg)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r  # which env vars are set is known only where it runs
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("TEST_BUS_PASSWORD_UNSET", "RADIXFLEET_AGENT_TOKEN")
    }
    r = subprocess.run(
        radixfleet_argv("router", "--config", str(cfg), "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2, r
    err = r.stderr.strip()
    assert "Traceback" not in err and err.splitlines()[-1].endswith(
        "bus.auth.password_env: environment variable TEST_BUS_PASSWORD_UNSET is not set or empty"
    ), err
    r = subprocess.run(
        radixfleet_argv(
            "agent",
            "--port",
            str(free_port()),
            "--bus",
            "nats://127.0.0.1:4222",
            "--bus-user",
            "a",
            "--bus-password-env",
            "TEST_BUS_PASSWORD_UNSET",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r
    assert r.stderr.strip().endswith(
        "--bus-password-env: environment variable TEST_BUS_PASSWORD_UNSET is not set or empty"
    ), r.stderr


class Shipped:
    """deploy/bus/nats-server.conf and deploy/bus/router.yaml as deploy/README.md
    shows them, paths, host and port substituted (``local``), with TLS certificates,
    the router's password and an agent NKey made in ``folder``; the environment the
    server and the routers read (``monkeypatch``)."""

    def __init__(self, folder, monkeypatch) -> None:
        self.folder = folder
        self.certs = make_certs(folder)
        self.public, self.seed_file = nkey_user(folder)
        (folder / "router-password").write_text(ROUTER_PASSWORD + "\n")
        self.port = free_port()
        self.conf = self.local(open("deploy/bus/nats-server.conf").read())
        monkeypatch.setenv("ROUTER_BUS_PASSWORD", ROUTER_PASSWORD)  # read by nats-server
        monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", AGENT_TOKEN)

    def local(self, text: str) -> str:
        return (
            text.replace("/etc/radixfleet/bus/", f"{self.folder}/")
            .replace("/data/nats", str(self.folder / "js"))
            .replace("nats:4222", f"127.0.0.1:{self.port}")
            .replace("port: 4222", f"port: {self.port}")
            .replace("UAGENTPUBLICKEYGOESHERE", self.public)
        )

    def router(self, replica: str, extra: dict | None = None) -> Router:
        """A router from deploy/bus/router.yaml (``extra``'s sections added), with
        test-fast timers."""
        from dataclasses import replace

        from radixfleet.config import load_config

        doc = yaml.safe_load(self.local(open("deploy/bus/router.yaml").read()))
        path = self.folder / f"router-{replica}.yaml"
        path.write_text(yaml.safe_dump({**doc, **(extra or {})}))
        cfg = load_config(str(path))
        cfg = replace(
            cfg,
            bus=replace(
                cfg.bus,
                replica_id=replica,
                heartbeat_s=0.2,
                replica_ttl_s=1.0,
                backoff_s=0.1,
                backoff_max_s=0.5,
            ),
            health=replace(cfg.health, interval_s=0.2),
        )
        return Router(cfg)

    def agent(self) -> Proc:
        """``radixfleet agent`` with the flags deploy/README.md lists (NKey, TLS)."""
        c = self.certs
        return agent_proc(
            f"tls://127.0.0.1:{self.port}",
            "--bus-nkey-seed-file",
            self.seed_file,
            "--bus-tls-ca-file",
            c["ca"],
            "--bus-tls-cert-file",
            c["client_cert"],
            "--bus-tls-key-file",
            c["client_key"],
        )


@bounded()
async def test_the_documented_secure_bus_configuration_works(tmp_path, monkeypatch):
    """deploy/bus/nats-server.conf and deploy/bus/router.yaml as deploy/README.md
    shows them (paths, host and port substituted), with the agent flags it lists:
    the router and the agent join over mutual TLS, and the subject permissions keep
    an agent from publishing as a router."""
    shipped = Shipped(tmp_path, monkeypatch)
    seed_file = shipped.seed_file
    with NatsServer(shipped.port, config=shipped.conf) as ns:
        a = shipped.router("ra")
        sa, ua = await start(a)
        p = shipped.agent().__enter__()
        try:
            await wait_for(lambda: a.bus.conn.up and a.bus.caught_up, 15, "router over TLS")
            await wait_for(
                lambda: "ag0" in [v.id for v in a.pool.views(time.monotonic())],
                20,
                "agent registered over the bus and healthy",
            )
            async with httpx.AsyncClient(timeout=30) as c:
                assert (await chat(c, ua, "a secured bus")).status_code == 200
            # an agent's NATS identity cannot publish a router message at all; the
            # router's can (the message is then dropped by the checks: a positive control)
            evil = json.dumps(
                {
                    "v": 1,
                    "kind": "router",
                    "replica": "evil",
                    "seq": 1,
                    "block_bytes": 128,
                    "inflight": {"ag0": [10**30, 1]},
                }
            ).encode()
            tls = a.bus.conn._options["tls"]
            as_agent = await nats.connect(ns.url, nkeys_seed=seed_file, tls=tls, tls_hostname="127.0.0.1")
            as_router = await nats.connect(
                ns.url, user="router", password=ROUTER_PASSWORD, tls=tls, tls_hostname="127.0.0.1"
            )
            try:
                await as_agent.publish("radixfleet.router.evil", evil)
                await as_agent.flush()
                await asyncio.sleep(1.0)
                assert metric(a, "radixfleet_bus_bad_messages_total", cause="unsigned") == 0
                await as_router.publish("radixfleet.router.evil", evil)
                await as_router.flush()
                await wait_for(
                    lambda: metric(a, "radixfleet_bus_bad_messages_total", cause="unsigned") == 1,
                    5,
                    "control counted",
                )
            finally:
                await as_agent.close()
                await as_router.close()
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()


@bounded()
async def test_two_routers_on_the_shipped_secure_bus_hold_one_fleet_wide_limit(tmp_path, monkeypatch):
    """The shipped server config lets routers publish their rate-limit consumption
    (``radixfleet.limits.*``): a tenant limited to R = 10 requests/s (burst 10) sends
    2R for 5 s, alternating between two replicas made from deploy/bus/router.yaml,
    and the fleet admits one limit, within [45, 70] (as on an open bus:
    tests/bus/test_bus.py); the server refused nothing. Before, the server dropped
    every limits message and each replica admitted its own R (about 100)."""
    shipped = Shipped(tmp_path, monkeypatch)
    rate, seconds = 10, 5.0
    with NatsServer(shipped.port, config=shipped.conf):
        a, b = shipped.router("ra", ACME), shipped.router("rb", ACME)
        (sa, ua), (sb, ub) = await start(a), await start(b)
        p = shipped.agent().__enter__()
        try:
            for r, peer in ((a, "rb"), (b, "ra")):
                await wait_for(
                    lambda r=r, peer=peer: (
                        len(r.pool.views(time.monotonic())) == 1 and peer in r.bus.remote.replicas
                    ),
                    20,
                    "the agent registered and the peer heard",
                )
            statuses = await tenant_load([ua, ub], "acme", 2 * rate, seconds)
            ok = statuses.count(200)
            print(f"admitted {ok} of {len(statuses)} at {2 * rate} req/s for a {rate} req/s limit")
            assert statuses.count(429) == len(statuses) - ok, sorted(set(statuses))
            assert 0.9 * rate * seconds <= ok <= rate * seconds + 2 * rate, ok
            for r in (a, b):
                assert metric(r, "radixfleet_bus_messages_received_total", kind="limits") > 0
                refused = r.metrics.registry.get_sample_value(
                    "radixfleet_bus_permission_violations_total", {"op": "publish", "kind": "limits"}
                )
                assert refused is None, refused
        finally:
            p.__exit__(None, None, None)
            await sa.aclose()
            await sb.aclose()


@bounded()
async def test_a_publish_the_server_refuses_is_counted_and_logged(tmp_path, monkeypatch, caplog):
    """A server whose router permissions lack ``radixfleet.limits.*`` (the shipped
    config before it had them) drops the router's limits messages: nats-py only
    hears a ``Permissions Violation`` through its error callback. The router counts
    each in ``radixfleet_bus_permission_violations_total{op="publish",kind="limits"}``
    and logs one ERROR line naming the subject (not one per message), and stays up."""
    conf = f"""authorization {{
  users = [
    {{user: router, password: "{ROUTER_PASSWORD}", permissions: {{
      publish: ["radixfleet.router.*", "radixfleet.ctl.snapshot.*", "$JS.API.>", "$JS.FC.>"]
      subscribe: ["radixfleet.>", "_INBOX.>"]
    }}}}
  ]
}}
"""
    monkeypatch.setenv("TEST_BUS_PASSWORD", ROUTER_PASSWORD)
    caplog.set_level(logging.INFO)
    with NatsServer(free_port(), config=conf) as ns:
        a = bus_router(ns.url, ACME, auth={"user": "router", "password_env": "TEST_BUS_PASSWORD"})
        sa, _ = await start(a)
        try:
            await wait_for(lambda: a.bus.conn.up and a.bus.caught_up, 10, "router on the bus")

            def refused() -> float:
                return metric(a, "radixfleet_bus_permission_violations_total", op="publish", kind="limits")

            for n in (1, 2, 3):  # consumption to publish, one limits message each interval
                a.dataplane.tenancy.admit("acme", "", "llama-3-8b", {}, 0, {}, time.monotonic())
                await wait_for(lambda n=n: refused() >= n, 5, f"refusal {n} counted")
            assert metric(a, "radixfleet_bus_messages_published_total", kind="limits") >= 3
            assert a.bus.conn.up  # a refusal is not an outage
            assert metric(a, "radixfleet_bus_permission_violations_total", op="publish", kind="router") == 0
        finally:
            await sa.aclose()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1, lines
    assert "publish 'radixfleet.limits.ra'" in lines[0] and "[publish limits]" in lines[0], lines
    assert "Traceback" not in caplog.text
