"""What a router replica or an agent accepts from the bus: every number bounded as
the HTTP agent API bounds it (radixfleet.wire.events, radixfleet.wire.identifiers), registration
signed with the agent credential (radixfleet.wire.bus_wire.BusKey), and whatever fails
dropped and counted per cause before it reaches the pool or a policy.

Unit tests, no server: the live replicas against a real nats-server are in
tests/chaos/test_bus.py and tests/bus/test_auth.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from radixfleet.bus.replica import BusReplica
from radixfleet.common.bus_connection import (
    BusConnection,
    BusCredentials,
    BusMetrics,
    Problems,
    check_exposure,
    permission_violation,
)
from radixfleet.config import parse_config
from radixfleet.fleet.pool import Source
from radixfleet.server.app import Router
from radixfleet.wire import events
from radixfleet.wire.bus_wire import (
    MAX_ENTRIES,
    MAX_HINT_AGE_S,
    SIGNATURE_HEADER,
    BadMessage,
    BusKey,
    RouterMessage,
    Subjects,
    parse_agent,
    parse_load,
    parse_router,
    parse_snapshot_request,
    worker_token,
)
from radixfleet.wire.errors import ConfigError, MalformedRequest
from radixfleet.wire.events import MAX_LOAD_COUNT

pytestmark = pytest.mark.usefixtures("bus_salt")

TOKEN = b"agent-secret"


def router_msg(**fields) -> bytes:
    return json.dumps(
        {"v": 1, "kind": "router", "replica": "r1", "seq": 1, "block_bytes": 128, **fields}
    ).encode()


def agent_msg(batch: dict, register: dict | None = None) -> bytes:
    obj = {"v": 1, "kind": "agent", "batch": batch}
    if register is not None:
        obj["register"] = register
    return json.dumps(obj).encode()


SNAPSHOT = {
    "worker_id": "busevil",
    "url": "http://127.0.0.1:9",
    "epoch": "e1",
    "seq": 0,
    "events": [{"type": "snapshot", "blocks": []}],
}


def cause(fn, *args) -> str:
    with pytest.raises(BadMessage) as e:
        fn(*args)
    return e.value.cause


# ------------------------------------------------------------ router messages


@pytest.mark.parametrize(
    "fields",
    [
        {"inflight": {"w1": [10**400, 10**400]}},  # made every decision raise OverflowError
        {"inflight": {"w1": [MAX_LOAD_COUNT + 1, 0]}},
        {"inflight": {"w1": [0, MAX_LOAD_COUNT + 1]}},
        {"inflight": {"w1": [1.0, 2]}},
        {"inflight": {"w1": [True, 2]}},
        {"inflight": {"": [1, 2]}},
        {"inflight": {"x" * 129: [1, 2]}},
        {"inflight": {"w\n1": [1, 2]}},
        {"inflight": {f"w{i}": [1, 1] for i in range(MAX_ENTRIES + 1)}},
        {"hints": [["w1", 10**400, [1]]]},
        {"hints": [["w1", MAX_HINT_AGE_S + 1, [1]]]},
        {"hints": [["w1", -0.5, [1]]]},
        {"hints": [["", 0.1, [1]]]},
        {"hints": [["w1", 0.1, [-1]]]},
        {"hints": [["w1", 0.1, list(range(MAX_ENTRIES + 1))]]},
        {"repl": [["add", 1, 10**400, "w1"]]},
        {"repl": [["add", 1, 2, "-w"]]},
        {"seq": 10**400},
        {"block_bytes": 10**400},
        {"replica": "r" * 129},
        {"replica": "a.b"},
    ],
)
def test_router_messages_out_of_bounds_are_refused(fields):
    assert cause(parse_router, router_msg(**fields)) == "bad_router"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"v": 1, "kind": "router", "replica": "r1", "seq": 1, "block_bytes": 128, '
        b'"hints": [["w1", NaN, [1]]]}',
        b'{"v": 1, "kind": "router", "replica": "r1", "seq": 1, "block_bytes": 128, '
        b'"hints": [["w1", Infinity, [1]]]}',
        b'{"v": 1, "kind": "router", "replica": "r1", "seq": 1, "block_bytes": 128, '
        b'"hints": [["w1", 1e400, [1]]]}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_bus_json_is_rfc8259_with_finite_numbers(raw):
    assert cause(parse_router, raw) == "not_json"


def test_router_messages_at_the_bounds_are_applied_whole():
    m = parse_router(
        router_msg(
            inflight={"w1": [MAX_LOAD_COUNT, MAX_LOAD_COUNT]},
            hints=[["w1", MAX_HINT_AGE_S, [0, (1 << 64) - 1]]],
            repl=[["add", 7, 3, "w1"]],
        )
    )
    assert m.inflight == {"w1": (MAX_LOAD_COUNT, MAX_LOAD_COUNT)}
    assert m.hints == [("w1", MAX_HINT_AGE_S, [0, (1 << 64) - 1])]
    assert m.repl == [("add", 7, 3, "w1")]
    back = parse_router(
        RouterMessage(
            "r1", 3, 128, True, {"10.0.0.1:8000": (1, 2)}, [("10.0.0.1:8000", 0.25, [5])]
        ).to_bytes()
    )
    assert back.inflight == {"10.0.0.1:8000": (1, 2)} and back.full


# ------------------------------------------------- agents: the HTTP API's checks


def test_bus_load_numbers_have_the_agent_apis_bounds():
    tok = worker_token("w1")
    batch = {"worker_id": "w1", "url": "http://h:1", "epoch": "e", "seq": 0, "events": []}
    for load in (
        {"queued_tokens": MAX_LOAD_COUNT + 1},
        {"queued_tokens": 10**400},
        {"prefill_tokens_per_s": 1e13},
        {"running_requests": -1},
        {"queued_prefill_tokens": -1},
    ):
        data = json.dumps({"v": 1, "kind": "load", "batch": {**batch, "load": load}}).encode()
        assert cause(parse_load, data, tok) == "bad_batch"
        with pytest.raises(MalformedRequest):  # what POST /internal/v1/events answers 400
            events.parse_batch({**batch, "load": load})
    ok = {"v": 1, "kind": "load", "batch": {**batch, "load": {"queued_tokens": MAX_LOAD_COUNT}}}
    assert parse_load(json.dumps(ok).encode(), tok).load.queued_tokens == MAX_LOAD_COUNT


def test_a_load_without_queued_prefill_tokens_reads_it_as_queued_tokens():
    """An older agent's report (whole prompts only): shedding reads what it sent."""
    batch = {"worker_id": "w1", "url": "http://h:1", "epoch": "e", "seq": 0, "events": []}
    old = events.parse_batch({**batch, "load": {"queued_tokens": 900}}).load
    assert (old.queued_tokens, old.queued_prefill_tokens) == (900, 900)
    new = events.parse_batch({**batch, "load": {"queued_tokens": 900, "queued_prefill_tokens": 40}}).load
    assert (new.queued_tokens, new.queued_prefill_tokens) == (900, 40)
    sent = events.Load(queued_tokens=900, queued_prefill_tokens=0)  # all of it cached
    back = events.parse_batch({**batch, "load": {f: getattr(sent, f) for f in events.Load.__slots__}}).load
    assert back == sent


@pytest.mark.parametrize(
    "register",
    [
        {"models": ["m"] * 65},
        {"models": ["bad\x00name"]},
        {"models": "llama"},
        {"block_bytes": 0},
        {"block_bytes": 10**400},
    ],
)
def test_bus_registration_has_the_http_registrations_checks(register):
    """The same function refuses it on both paths, with the same words."""
    reg = {"worker_id": SNAPSHOT["worker_id"], "url": SNAPSHOT["url"], "epoch": SNAPSHOT["epoch"], **register}
    with pytest.raises(MalformedRequest) as http:
        events.parse_registration(reg)
    with pytest.raises(BadMessage) as bus:
        parse_agent(agent_msg(SNAPSHOT, register), worker_token("busevil"))
    assert bus.value.cause == "bad_register" and str(bus.value) == http.value.message


def test_bus_batches_name_bounded_workers_and_epochs():
    for wid, epoch in (("x" * 129, "e"), ("w1", "e" * 129), ("w1", "e\n")):
        b = {**SNAPSHOT, "worker_id": wid, "epoch": epoch}
        assert cause(parse_agent, agent_msg(b), worker_token(wid)) == "bad_batch"
    assert (
        cause(
            parse_snapshot_request,
            json.dumps({"v": 1, "kind": "snapshot_request", "worker_id": "x" * 200}).encode(),
        )
        == "bad_snapshot_request"
    )


# ------------------------------------------------------------------ signatures


def test_signed_messages_verify_and_every_change_is_caught():
    key = BusKey(TOKEN)
    subject = Subjects("radixfleet").agent("w1")
    data = agent_msg(SNAPSHOT, {"models": ["m"]})
    now = time.time()
    h = key.sign(subject, data, now)
    assert set(h) == {SIGNATURE_HEADER} and TOKEN.decode() not in h[SIGNATURE_HEADER]
    key.verify(subject, data, h, now)
    key.verify(subject, data, h, now + 29.0)  # within max_skew_s of its store time
    checks = [
        (subject, data, None, "unsigned"),
        (subject, data, {}, "unsigned"),
        (subject, data + b" ", h, "bad_signature"),  # the body changed
        (Subjects("radixfleet").agent("w2"), data, h, "bad_signature"),  # another subject
        (subject, data, BusKey(b"guess").sign(subject, data, now), "bad_signature"),
        (subject, data, {SIGNATURE_HEADER: "v1 123 zz"}, "bad_signature"),
        (
            subject,
            data,
            {
                SIGNATURE_HEADER: h[SIGNATURE_HEADER].replace(
                    h[SIGNATURE_HEADER].split()[1], str(int(now * 1000) + 1)
                )
            },
            "bad_signature",
        ),
    ]
    for subj, body, headers, want in checks:
        assert cause(key.verify, subj, body, headers, now) == want
    # a captured message published again later: stored long after it was signed
    assert cause(key.verify, subject, data, h, now + 31.0) == "stale"
    assert cause(key.verify, subject, data, key.sign(subject, data, now + 60), now) == "stale"


def test_without_an_agent_token_nothing_is_signed_and_only_loopback_is_allowed():
    open_key = BusKey(b"")
    assert not open_key.signs and open_key.sign("s", b"x") == {}
    open_key.verify("s", b"x", None)
    check_exposure("nats://127.0.0.1:4222", b"", "bus.url")
    check_exposure("nats://10.0.0.5:4222", TOKEN, "bus.url")
    with pytest.raises(ConfigError, match="bus.url: a bus on 10.0.0.5 .*RADIXFLEET_AGENT_TOKEN"):
        check_exposure("nats://10.0.0.5:4222", b"", "bus.url")


# ------------------------------------------------ a replica's entry points


def replica(token: bytes = TOKEN) -> tuple[Router, BusReplica]:
    r = Router(
        parse_config(
            {
                "bus": {"url": "nats://127.0.0.1:4222", "replica_id": "me"},
                "workers": ["http://127.0.0.1:9001"],
            }
        )
    )
    b = BusReplica(
        r.cfg.bus,
        pool=r.pool,
        index=r.index,
        feedback=r.feedback,
        block_bytes=r.cfg.keys.block_bytes,
        registry=r.metrics.registry,
        agent_token=token,
    )
    return r, b


def bad(r: Router, cause: str) -> float:
    return r.metrics.registry.get_sample_value("radixfleet_bus_bad_messages_total", {"cause": cause}) or 0.0


def msg(subject: str, data: bytes, headers=None):
    return SimpleNamespace(subject=subject, data=data, headers=headers, metadata=None)


def test_a_replica_drops_out_of_bounds_counts_before_the_pool_sees_them(caplog):
    r, b = replica()
    subject = b.subjects.router("evil")
    data = json.dumps(
        {
            "v": 1,
            "kind": "router",
            "replica": "evil",
            "seq": 1,
            "block_bytes": 128,
            "inflight": {"127.0.0.1:9001": [10**400, 10**400]},
        }
    ).encode()
    for _ in range(5):
        asyncio.run(b._on_router(msg(subject, data, b.key.sign(subject, data))))
    w = r.pool.get("127.0.0.1:9001")
    assert (w.remote_in_flight, w.remote_tokens) == (0, 0) and not b.remote.replicas
    assert bad(r, "bad_router") == 5
    logged = [
        rec for rec in caplog.records if "bad_router" in rec.getMessage() or "inflight" in rec.getMessage()
    ]
    assert len(logged) == 1 and logged[0].exc_info is None  # once per cause, no traceback
    b.check()


def test_a_replica_drops_unsigned_and_forged_registrations():
    r, b = replica()
    wid = "busevil"
    subject = b.subjects.agent(wid)
    data = agent_msg(SNAPSHOT, {"models": ["llama-3-8b"], "block_bytes": 128})
    for headers, why in (
        (None, "unsigned"),
        (BusKey(b"guess").sign(subject, data), "bad_signature"),
        ({SIGNATURE_HEADER: "v1 0 " + "0" * 64}, "bad_signature"),
    ):
        asyncio.run(b._on_agent(msg(subject, data, headers)))
        assert r.pool.get(wid) is None
        assert bad(r, why) >= 1
    asyncio.run(b._on_agent(msg(subject, data, b.key.sign(subject, data))))
    w = r.pool.get(wid)
    assert w is not None and w.source is Source.AGENT  # the agent credential: accepted


def test_a_bus_registration_takes_the_agent_apis_url_rule():
    """A signed registration naming the router's own listener, or (``registration.allow``
    set) a host outside it, is dropped as POST /register refuses it."""
    r = Router(
        parse_config({"bus": {"url": "nats://127.0.0.1:4222"}, "registration": {"allow": ["127.0.0.0/8"]}})
    )
    b = BusReplica(
        r.cfg.bus,
        pool=r.pool,
        index=r.index,
        feedback=r.feedback,
        block_bytes=r.cfg.keys.block_bytes,
        registry=r.metrics.registry,
        agent_token=TOKEN,
        url_check=r._check_worker_url,
    )
    r.registration.listening([("127.0.0.1", 8000)])
    for wid, url, why in (
        ("busself", "http://127.0.0.1:8000", "worker_url_is_router"),
        ("busfar", "http://10.0.0.9:1", "worker_host_not_allowed"),
    ):
        subject = b.subjects.agent(wid)
        data = agent_msg({**SNAPSHOT, "worker_id": wid, "url": url}, {"models": ["m"], "block_bytes": 128})
        asyncio.run(b._on_agent(msg(subject, data, b.key.sign(subject, data))))
        assert r.pool.get(wid) is None and bad(r, why) == 1
    subject = b.subjects.agent("busok")
    data = agent_msg({**SNAPSHOT, "worker_id": "busok", "url": "http://127.0.0.1:9"}, {"models": ["m"]})
    asyncio.run(b._on_agent(msg(subject, data, b.key.sign(subject, data))))
    assert r.pool.get("busok") is not None


def test_bus_credentials_check_statically_and_read_secrets_at_start(tmp_path, monkeypatch):
    where = lambda f: f"bus.auth.{f}"  # noqa: E731
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    opts = BusCredentials(user="u", password_file=str(pw)).connect_options("nats://127.0.0.1:4222", where)
    assert opts == {"user": "u", "password": "s3cret"}
    monkeypatch.delenv("NO_SUCH_BUS_TOKEN", raising=False)
    with pytest.raises(
        ConfigError, match="bus.auth.token_env: environment variable NO_SUCH_BUS_TOKEN is not set"
    ):
        BusCredentials(token_env="NO_SUCH_BUS_TOKEN").connect_options("nats://h:1", where)
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="bus.auth.token_file: .* is empty"):
        BusCredentials(token_file=str(tmp_path / "empty")).connect_options("nats://h:1", where)
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate")
    with pytest.raises(ConfigError, match="bus.auth.tls_ca_file: cannot load the CA"):
        BusCredentials(tls_ca_file=str(bad_ca)).connect_options("tls://h:1", where)


def test_an_agent_checks_the_snapshot_requests_it_obeys():
    from radixfleet_tools.agent.bus import AgentBus
    from radixfleet_tools.agent.reporter import LinkState

    bus = AgentBus("nats://127.0.0.1:4222", worker_id="w1", token=TOKEN.decode())
    bus.link.state = LinkState.STREAMING
    subject = bus.subjects.snapshot_request("w1")
    data = json.dumps({"v": 1, "kind": "snapshot_request", "worker_id": "w1", "replica": "r1"}).encode()
    for headers in (None, BusKey(b"guess").sign(subject, data)):
        asyncio.run(bus._on_request(msg(subject, data, headers)))
        assert bus.link.state is LinkState.STREAMING  # a stranger cannot make it resend
    assert bus.metrics.bad.labels("unsigned")._value.get() == 1
    assert bus.metrics.bad.labels("bad_signature")._value.get() == 1
    asyncio.run(bus._on_request(msg(subject, data, BusKey(TOKEN).sign(subject, data))))
    assert bus.link.state is LinkState.SNAPSHOT


def test_problems_log_a_cause_once_then_once_a_minute_with_the_count(caplog):
    from prometheus_client import CollectorRegistry, Counter

    now = [0.0]
    c = Counter("t_bad", "t", ["cause"], registry=CollectorRegistry())
    p = Problems(c, "bus messages", every_s=60.0, clock=lambda: now[0])
    with caplog.at_level("DEBUG", logger="radixfleet.bus"):
        for t in range(0, 130, 2):  # a bad message every 2 s for 130 s
            now[0] = float(t)
            p.report("unsigned", "ignored a message on %s", "s")
        p.report("stale", "ignored a message on %s", "s")
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert lines == [
        "bus messages: ignored a message on s [unsigned]",
        "bus messages: ignored a message on s [unsigned] (29 more since the last line)",
        "bus messages: ignored a message on s [unsigned] (29 more since the last line)",
        "bus messages: ignored a message on s [stale]",
    ]
    assert c.labels("unsigned")._value.get() == 65


def test_the_servers_permission_refusals_are_counted_by_op_and_kind_and_logged(caplog):
    """nats-py hands the server's ``-ERR 'Permissions Violation ...'`` (lowercased) to
    the error callback; the connection counts it by op and the subject's kind and
    logs one ERROR line per op and kind (tests/bus/test_auth.py: against a server)."""
    import nats.errors
    from prometheus_client import CollectorRegistry

    def err(text: str) -> Exception:
        return nats.errors.Error(f"nats: {text.lower()}")

    assert permission_violation(err('Permissions Violation for Publish to "Fleet.limits.R1"')) == (
        "publish",
        "fleet.limits.r1",
    )
    assert permission_violation(err('Permissions Violation for Subscription to "fleet.>"')) == (
        "subscribe",
        "fleet.>",
    )
    assert permission_violation(err('Permissions Violation for Publish with Reply of "_INBOX.x"')) == (
        "reply",
        "_inbox.x",
    )
    assert permission_violation(err("Permissions Violation")) == ("other", "")
    assert permission_violation(err("Authorization Violation")) is None
    subjects = Subjects("Fleet")
    kinds = [
        subjects.kind(x.lower())
        for x in (
            subjects.limits("R1"),
            subjects.router("r"),
            subjects.agent("w"),
            subjects.load("w"),
            subjects.snapshot_request("w"),
            "$JS.API.STREAM.INFO.X",
            "_INBOX.abc",
            "Fleet.other.x",
            "elsewhere.limits.r",
        )
    ]
    assert kinds == [
        "limits",
        "router",
        "agent",
        "load",
        "snapshot_request",
        "jetstream",
        "inbox",
        "other",
        "other",
    ]
    metrics = BusMetrics(CollectorRegistry())

    async def never_up(nc, js) -> None:  # the connection is never started
        raise AssertionError("not started")

    conn = BusConnection(
        "nats://127.0.0.1:1", name="router-r1", metrics=metrics, on_up=never_up, subjects=subjects
    )
    with caplog.at_level("INFO", logger="radixfleet.bus"):
        for _ in range(5):
            asyncio.run(conn._on_error(err('Permissions Violation for Publish to "Fleet.limits.R1"')))
        asyncio.run(conn._on_error(err('Permissions Violation for Subscription to "Fleet.router.*"')))
    assert metrics.violations.labels("publish", "limits")._value.get() == 5
    assert metrics.violations.labels("subscribe", "router")._value.get() == 1
    assert conn._last_error is None  # not a reason a connect failed
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 2 and "publish 'fleet.limits.r1' (limits messages, lost)" in lines[0], lines
    assert lines[0].endswith("[publish limits]") and lines[1].endswith("[subscribe router]"), lines


@pytest.mark.parametrize(
    "bus, where",
    [
        ({"url": "nats://router:hunter2@10.0.0.1:4222"}, "bus.url"),
        ({"url": "nats://h:1", "auth": {"user": "u"}}, "bus.auth.password_env"),
        ({"url": "nats://h:1", "auth": {"password_env": "P"}}, "bus.auth.user"),
        (
            {"url": "nats://h:1", "auth": {"token_env": "T", "nkey_seed_file": "/etc/hostname"}},
            "bus.auth.nkey_seed_file",
        ),
        (
            {"url": "nats://h:1", "auth": {"token_env": "T", "token_file": "/etc/hostname"}},
            "bus.auth.token_file",
        ),
        ({"url": "nats://h:1", "tls": {"ca_file": "/etc/hostname"}}, "bus.tls.ca_file"),
        ({"url": "tls://h:1", "tls": {"cert_file": "/etc/hostname"}}, "bus.tls.key_file"),
        ({"url": "tls://h:1", "auth": {"creds_file": "/no/such.creds"}}, "bus.auth.creds_file"),
        ({"url": "nats://h:1", "max_skew_s": 0}, "bus.max_skew_s"),
    ],
)
def test_config_bus_auth_and_tls_are_checked_with_paths(bus, where):
    with pytest.raises(ConfigError) as e:
        parse_config({"bus": bus})
    assert str(e.value).startswith(where + ":"), str(e.value)
    assert "hunter2" not in str(e.value)
