"""Unit tests of the router's parts: pool (breaker, health, views, load), feedback,
admission, tenants, the upstream client's response parser, and the front's
chunked-body framing follower."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from radixfleet.common.auth import BearerAuth, is_loopback
from radixfleet.config import parse_config
from radixfleet.fleet.pool import Breaker, HealthState, Source
from radixfleet.index.feedback import Feedback
from radixfleet.keys import Endpoint
from radixfleet.server.auth import TenantResolver, check_metrics, metrics_exposure
from radixfleet.server.dataplane import Admission
from radixfleet.server.screen import check_parsed, check_raw, peek_model, unserved
from radixfleet.server.upstream import (
    _DONE,
    STREAM_HIGH,
    Cancel,
    Cancelled,
    ConnectFailed,
    DeadlinePassed,
    NoAnswer,
    Response,
    ResponseTooLarge,
    UpstreamBroken,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
    build_head,
    finish_outcome,
)
from radixfleet.wire.errors import Conflict, MalformedRequest, Overloaded, Unauthorized
from radixfleet.wire.events import Cleared, EventBatch, Load, Removed, Snapshot, Stored
from radixfleet_tools.harness.procs import free_port
from tests.router.pools import make_pool

# -------------------------------------------------------------------- pool


def test_pool_views_count_load_at_pick_time_and_cache():
    pool, idx, clock = make_pool()
    views = pool.views(clock())
    assert [v.id for v in views] == ["a", "b"]
    assert all(v.in_flight == 0 for v in views)
    a = pool.get("a")
    pool.pick(a, 300)
    v2 = pool.views(clock())
    assert v2[0].in_flight == 1 and v2[0].in_flight_tokens == 300
    assert v2[1] is views[1]  # untouched worker: the cached view is reused
    pool.prefilled(a, 300)
    assert pool.views(clock())[0].in_flight_tokens == 0
    pool.finish(a, 0, True)
    assert pool.views(clock())[0].in_flight == 0
    pool.check()


def test_pool_holds_a_requests_kv_from_pick_to_finish():
    """``in_flight_kv``: the prompt tokens of requests in flight until they finish (the
    KV they hold while decoding), unlike ``in_flight_tokens``, which the first token
    releases; it returns to 0 with a worker's last request."""
    pool, idx, clock = make_pool()
    a = pool.get("a")
    pool.pick(a, 300, 1_000)  # 300 uncached of a 1,000-token prompt
    pool.pick(a, 50)  # held not told: the counted tokens
    v = pool.views(clock())[0]
    assert (v.in_flight_tokens, v.in_flight_kv_tokens) == (350, 1_050)
    pool.prefilled(a, 300)
    v = pool.views(clock())[0]
    assert (v.in_flight_tokens, v.in_flight_kv_tokens) == (50, 1_050)
    pool.finish(a, 0, True, 1_000)
    assert pool.views(clock())[0].in_flight_kv_tokens == 50
    pool.check()
    pool.finish(a, 50, None)  # its held tokens not told: the last request clears it
    assert pool.views(clock())[0].in_flight_kv_tokens == 0
    pool.check()


def test_reported_load_combines_and_goes_stale():
    pool, idx, clock = make_pool(load={"report_stale_s": 2.0})
    a = pool.get("a")
    pool.report_load(a, Load(queued_requests=3, queued_tokens=900, prefill_tokens_per_s=5e3), clock())
    pool.pick(a, 100)
    v = pool.views(clock())[0]
    assert (v.queued_tokens, v.in_flight_tokens, v.load_tokens) == (900, 100, 1000)
    assert v.prefill_tokens_per_s == 5e3
    clock.t += 2.5
    v = pool.views(clock())[0]
    assert (v.queued_tokens, v.queued_requests, v.in_flight_tokens) == (0, 0, 100)
    assert v.prefill_tokens_per_s == 10_000.0
    pool.finish(a, 100, None)
    pool.check()


def test_breaker_opens_half_opens_and_closes():
    pool, idx, clock = make_pool(breaker={"failure_threshold": 2, "open_s": 5.0})
    a = pool.get("a")
    for _ in range(2):
        pool.pick(a, 10)
        pool.finish(a, 10, False)
    assert a.breaker is Breaker.OPEN
    assert [v.id for v in pool.views(clock())] == ["b"]
    clock.t += 5.1
    assert [v.id for v in pool.views(clock())] == ["a", "b"]
    assert a.breaker is Breaker.HALF_OPEN
    pool.pick(a, 10)  # the one trial request
    assert [v.id for v in pool.views(clock())] == ["b"]
    pool.finish(a, 10, False)  # trial failed: open again
    assert a.breaker is Breaker.OPEN
    clock.t += 5.1
    pool.views(clock())
    pool.pick(a, 10)
    pool.finish(a, 10, True)
    assert a.breaker is Breaker.CLOSED
    assert [v.id for v in pool.views(clock())] == ["a", "b"]
    pool.check()


def test_unhealthy_or_removed_worker_leaves_index_at_once():
    pool, idx, clock = make_pool(health={"failure_threshold": 2})
    idx.insert("a", [1, 2, 3], clock())
    idx.insert("b", [1, 2], clock())
    pool._set_health(pool.get("a"), HealthState.UNHEALTHY)
    assert idx.workers() == {"b"}
    assert idx.match([1, 2, 3], clock(), count=False).blocks == {"b": 2}
    pool.check()
    idx.check()
    pool.remove("b")
    assert idx.workers() == set() and idx.stats().nodes == 0
    assert pool.get("b") is None and len(pool) == 1
    pool.check()


def test_drain_and_sync_config():
    pool, idx, clock = make_pool()
    pool.drain("a")
    assert [v.id for v in pool.views(clock())] == ["b"]
    pool.drain("a", False)
    assert [v.id for v in pool.views(clock())] == ["a", "b"]
    new = parse_config(
        {"workers": [{"url": "http://127.0.0.1:2", "id": "b"}, {"url": "http://127.0.0.1:3", "id": "c"}]}
    )
    idx.insert("a", [7], clock())
    added, removed = pool.sync_config(new.workers)
    assert (added, removed) == (["c"], ["a"])
    assert "a" not in idx.workers()
    assert pool.get("c").health is HealthState.UNKNOWN  # routable after its first check
    pool.check()


def test_register_new_epoch_drops_entries_and_adopts_config_worker():
    pool, idx, clock = make_pool()
    w = pool.register("agent-a", "http://127.0.0.1:1", "e1", ["m"])
    assert pool.get("a") is None and w.id == "agent-a" and w.source is Source.CONFIG
    idx.insert("agent-a", [5, 6], clock())
    pool.register("agent-a", "http://127.0.0.1:1", "e1")
    assert idx.workers() == {"agent-a"}  # same epoch: entries stay
    pool.register("agent-a", "http://127.0.0.1:1", "e2")
    assert idx.workers() == set() and w.next_seq == 0
    pool.check()


# ----------------------------------------------------------------- feedback


def test_feedback_rules():
    pool, idx, clock = make_pool()
    fb = Feedback(pool, idx)
    now = clock()
    url = "http://127.0.0.1:1"
    b = lambda seq, evs, epoch="e": EventBatch("a", url, epoch, seq, evs)  # noqa: E731
    assert fb.apply(b(0, []), now) == (404, "unknown_worker")  # its agent never registered
    pool.register("a", url, "e")
    assert fb.apply(EventBatch("zz", url, "e", 0, []), now) == (404, "unknown_worker")
    assert fb.apply(b(1, [Stored(None, [1, 2, 3])]), now) == (409, "snapshot_required")
    assert fb.apply(b(0, [Snapshot([(1, None), (2, 1)])]), now) == (200, "ok")
    assert idx.match([1, 2, 3], now, count=False).blocks == {"a": 2}
    assert fb.apply(b(1, [Stored(2, [3, 4])]), now) == (200, "ok")
    assert idx.match([1, 2, 3, 4], now, count=False).blocks == {"a": 4}
    assert fb.apply(b(3, [Removed([3])]), now) == (409, "snapshot_required")
    assert fb.apply(b(2, [Removed([3])]), now) == (200, "ok")
    assert idx.match([1, 2, 3, 4], now, count=False).blocks == {"a": 2}
    assert fb.apply(b(3, [Cleared()]), now) == (200, "ok")
    assert idx.workers() == set() or idx.match([1], now, count=False).blocks == {}
    idx.check()
    # an unhealthy worker's events are dropped; once healthy it must snapshot
    pool._set_health(pool.get("a"), HealthState.UNHEALTHY)
    assert fb.apply(b(4, [Stored(None, [9])]), now) == (200, "ok")
    assert "a" not in idx.workers()
    pool._set_health(pool.get("a"), HealthState.HEALTHY)
    assert fb.apply(b(5, [Stored(None, [9])]), now) == (409, "snapshot_required")
    assert fb.apply(b(6, [Snapshot([(9, None)])]), now) == (200, "ok")
    assert idx.match([9], now, count=False).blocks == {"a": 1}
    pool.check()
    idx.check()


def test_feedback_applies_only_the_registered_url_and_epoch():
    """Only the agent that registered speaks for its worker: a batch naming the id
    from another URL or another epoch changes nothing (404: the agent re-registers,
    and is refused if the id is someone else's). The URL is compared canonically."""
    pool, idx, clock = make_pool()
    fb = Feedback(pool, idx)
    now = clock()
    pool.register("a", "http://127.0.0.1:1", "e")
    snap = [Snapshot([(1, None)])]
    assert fb.apply(EventBatch("a", "http://127.0.0.1:19998", "e", 0, snap), now) == (404, "unknown_worker")
    assert fb.apply(EventBatch("a", "http://127.0.0.1:1", "other", 0, snap), now) == (404, "unknown_worker")
    assert idx.workers() == set()
    assert fb.apply(EventBatch("a", "http://0x7f.1:1/", "e", 0, snap), now) == (200, "ok")
    assert idx.match([1], now, count=False).blocks == {"a": 1}
    pool.check()
    idx.check()


def test_register_refuses_an_id_held_at_another_url():
    """A configured worker's id, or a live agent's, cannot be taken by a registration
    from another URL (409 worker_id_taken); a self-registered holder that is
    unhealthy (its agent moved) is replaced."""
    pool, idx, clock = make_pool()
    with pytest.raises(Conflict) as e:
        pool.register("a", "http://127.0.0.1:19998", "e")
    assert e.value.code == "worker_id_taken" and "127.0.0.1:1" not in e.value.message
    assert pool.get("a").url == "http://127.0.0.1:1"
    w = pool.register("ag", "http://127.0.0.1:7", "e1")
    with pytest.raises(Conflict):
        pool.register("ag", "http://127.0.0.1:8", "e2")
    pool._set_health(w, HealthState.UNHEALTHY)
    moved = pool.register("ag", "http://127.0.0.1:8", "e2")
    assert moved.url == "http://127.0.0.1:8" and pool.by_url("http://127.0.0.1:7") is None
    pool.check()


def test_register_refuses_a_role_that_contradicts_the_configured_entry():
    """A configured worker's role stands: an agent at its URL saying another role is
    refused (409 worker_role_conflict naming both); one saying nothing (``both``, the
    agent's default) or the same role is that worker. A self-registered agent that
    restarts with another role becomes a new entry with it."""
    pool, idx, clock = make_pool(
        workers=[
            {"url": "http://127.0.0.1:1", "id": "p", "role": "prefill"},
            {"url": "http://127.0.0.1:2", "id": "d", "role": "decode"},
        ]
    )
    with pytest.raises(Conflict) as e:
        pool.register("p", "http://127.0.0.1:1", "e", role="decode")
    assert e.value.code == "worker_role_conflict" and e.value.param == "role"
    assert "'decode'" in e.value.message and "'prefill'" in e.value.message
    with pytest.raises(Conflict):  # under another id, at the configured URL
        pool.register("other", "http://127.0.0.1:2", "e", role="prefill")
    assert {w.id: w.role for w in pool} == {"p": "prefill", "d": "decode"}
    assert pool.register("p", "http://127.0.0.1:1", "e").role == "prefill"
    assert pool.register("d", "http://127.0.0.1:2", "e", role="decode").role == "decode"
    ag = pool.register("ag", "http://127.0.0.1:7", "e1", role="prefill")
    assert ag.role == "prefill"
    again = pool.register("ag", "http://127.0.0.1:7", "e2", role="decode")
    assert again.role == "decode" and pool.get("ag") is again
    pool.check()


async def test_register_admits_new_workers_at_the_configured_rate():
    """A pool that probes (a router's) bounds new self-registered workers."""
    pool, idx, clock = make_pool(registration={"rate_per_s": 2.0, "burst": 3})
    async with aiohttp.ClientSession() as session:
        await pool.start(session)
        try:
            _admit_at_rate(pool, clock)
        finally:
            await pool.aclose()


def _admit_at_rate(pool, clock):
    for i in range(3):
        pool.register(f"n{i}", f"http://127.0.0.1:{100 + i}", "e")
    with pytest.raises(Overloaded) as e:
        pool.register("n3", "http://127.0.0.1:103", "e")
    assert 0 < e.value.retry_after_s <= 0.5
    pool.register("n0", "http://127.0.0.1:100", "e2")  # a known worker is never throttled
    clock.t += 0.5
    pool.register("n3", "http://127.0.0.1:103", "e")
    assert len(pool) == 2 + 4
    pool.check()


def test_unhealthy_self_registered_workers_are_reaped_after_the_grace():
    pool, idx, clock = make_pool(registration={"unhealthy_grace_s": 10.0})
    w = pool.register("ag", "http://127.0.0.1:7", "e1")
    pool._set_health(w, HealthState.UNHEALTHY)
    pool._set_health(pool.get("a"), HealthState.UNHEALTHY)
    clock.t += 9.0
    assert pool.reap(clock()) == []
    clock.t += 1.0
    assert pool.reap(clock()) == ["ag"] and pool.reaped == 1
    assert pool.get("ag") is None and pool.get("a") is not None  # configured: stays
    pool.check()


# ---------------------------------------------------------------- admission


async def test_admission_queue_hands_slots_over_in_order():
    adm = Admission(limit=1, max_queue=2, timeout_s=1.0, retry_after_s=2)
    assert adm.try_enter()
    order = []

    async def waiter(i):
        await adm.enter()
        order.append(i)
        await asyncio.sleep(0.01)
        adm.leave()

    tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as e:
        await adm.enter()
    assert e.value.retry_after_s == 2
    adm.leave()
    await asyncio.gather(*tasks)
    assert order == [0, 1] and adm.active == 0
    adm.check()


async def test_admission_timeout_and_cancel_hold_nothing():
    adm = Admission(limit=1, max_queue=4, timeout_s=0.05, retry_after_s=1)
    assert adm.try_enter()
    with pytest.raises(Overloaded, match="no slot within"):
        await adm.enter()
    t = asyncio.create_task(adm.enter())
    await asyncio.sleep(0.01)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert not adm._waiters
    adm.leave()
    assert adm.active == 0 and adm.try_enter()


async def test_admission_a_cancel_racing_the_hand_over_propagates_and_passes_the_slot_on():
    """A client gone as its slot arrives (both in one loop turn: a cancel storm) is
    cancelled, not admitted: the slot goes to the next waiter. (``asyncio.wait_for``
    before Python 3.12 returns the result and drops the cancellation.)"""
    adm = Admission(limit=1, max_queue=4, timeout_s=5.0, retry_after_s=1)
    assert adm.try_enter()
    first = asyncio.create_task(adm.enter())
    second = asyncio.create_task(adm.enter())
    await asyncio.sleep(0.01)
    adm.leave()  # the slot goes to the first waiter ...
    first.cancel()  # ... whose client left in the same turn
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the slot passed on
    assert adm.active == 1 and not adm._waiters
    adm.leave()
    assert adm.active == 0
    adm.check()


# ------------------------------------------------------------------ auth


def test_tenant_resolver_sources(monkeypatch):
    none = TenantResolver(parse_config({"keys": {"tenant": {"default": "d"}}}).keys.tenant)
    assert none.tenant({"x-tenant-id": "evil"}) == "d"
    hdr = TenantResolver(parse_config({"keys": {"tenant": {"source": "header"}}}).keys.tenant)
    assert hdr.tenant({"x-tenant-id": "t1"}) == "t1" and hdr.tenant({}) == ""
    monkeypatch.setenv("KA", "secret-a")
    cfg = parse_config(
        {
            "keys": {
                "tenant": {
                    "source": "api_key",
                    "api_keys": [{"tenant": "A", "key_env": "KA"}, {"tenant": "B", "key": "secret-b"}],
                }
            }
        }
    )
    r = TenantResolver(cfg.keys.tenant)
    assert r.tenant({"authorization": "Bearer secret-a"}) == "A"
    assert r.tenant({"x-api-key": "secret-b"}) == "B"
    with pytest.raises(Unauthorized, match="invalid API key"):
        r.tenant({"authorization": "Bearer nope"})
    with pytest.raises(Unauthorized, match="required"):
        r.tenant({})
    monkeypatch.delenv("KA")
    with pytest.raises(Exception, match=r"api_keys\[0\].key_env: environment variable KA"):
        TenantResolver(cfg.keys.tenant)


def test_only_the_default_tenant_of_clients_without_an_identity_is_anonymous():
    def resolver(tenant: dict) -> TenantResolver:
        return TenantResolver(parse_config({"keys": {"tenant": tenant}}).keys.tenant)

    assert resolver({"default": "d"}).anonymous("d")  # no tenants: everyone is one
    hdr = resolver({"source": "header"})
    assert hdr.anonymous("") and not hdr.anonymous("t1")  # no header: the default
    keys = [{"tenant": "A", "key": "ka"}, {"tenant": "pub", "key": "kp"}]
    required = resolver({"source": "api_key", "api_keys": keys, "default": "pub"})
    assert not required.anonymous("A") and not required.anonymous("pub")  # every client keyed
    optional = resolver({"source": "api_key", "api_keys": keys, "default": "pub", "require_key": False})
    assert optional.anonymous("pub") and not optional.anonymous("A")  # keyless clients land in pub


def test_metrics_answer_their_token_the_admin_token_or_a_loopback_peer_while_no_token_is_set(monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    monkeypatch.setenv("MET", "met")
    admin, metrics, unset = (
        BearerAuth("ADM", "admin"),
        BearerAuth("MET", "metrics"),
        BearerAuth("NONE", "metrics"),
    )
    for peer in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        check_metrics(unset, admin, None, peer)  # the quick start, a sidecar, port-forward
    for peer in ("10.1.2.3", "::ffff:10.1.2.3", "fe80::1", None):
        with pytest.raises(Unauthorized, match=r"loopback peers only until \$NONE is set"):
            check_metrics(unset, admin, None, peer)
        check_metrics(unset, admin, "Bearer adm", peer)
    for peer in ("127.0.0.1", "10.1.2.3"):
        with pytest.raises(Unauthorized, match="requires 'Authorization: Bearer <token>'"):
            check_metrics(metrics, admin, None, peer)  # a token set: loopback too
        with pytest.raises(Unauthorized, match="invalid metrics token"):
            check_metrics(metrics, admin, "Bearer nope", peer)
        check_metrics(metrics, admin, "Bearer met", peer)
        check_metrics(metrics, admin, "Bearer adm", peer)
    assert metrics_exposure(parse_config({"admin": {"host": "0.0.0.0"}}), unset)
    assert metrics_exposure(parse_config({"admin": {"host": "0.0.0.0"}}), metrics) is None
    assert metrics_exposure(parse_config({}), unset) is None  # loopback by default
    # /metrics is the admin listener's: a data port off loopback exposes none of it
    assert metrics_exposure(parse_config({"listen": {"host": "0.0.0.0"}}), unset) is None


def test_the_model_a_body_opens_with_is_read_without_parsing_it():
    assert peek_model(b'{"model": "m1", "messages": []}') == "m1"
    assert peek_model(b' \n{ "model" :"m-2","prompt":"x"}') == "m-2"
    assert peek_model(bytearray(b'{"model":"m","prompt":"' + b"x" * 10_000 + b'"}')) == "m"
    for body in (
        b'{"messages": [], "model": "m"}',  # not the first member: the parse decides
        b'{"model": "m", "prompt": "x", "model": "other"}',  # a later key wins in JSON
        b'{"model": "m", "lora_path": "ad", "prompt": "x"}',  # an adapter may serve it
        b'{"model": "m", "prompt": "", "lora_adapter": "ad"}',
        b'{"model": "a\\"b", "prompt": "x"}',  # escapes: the parse decides
        b'{"model": 3, "prompt": "x"}',
        b'{"model": "' + b"m" * 300 + b'"}',  # longer than any model name
        b'{"model": "\xff\xfe", "prompt": "x"}',  # not UTF-8: the parse's 400
        b"[1, 2]",
        b"",
    ):
        assert peek_model(body) is None, body


def test_a_request_nobody_serves_is_refused_before_it_is_keyed():
    pool, _, clock = make_pool()
    for w in pool:
        w.models = ("served",)
        pool._changed(w)
    clock.t += 10.0  # past the start-up grace (503 in it)
    now = clock.t
    assert unserved(pool, "served", None, now) is None
    assert unserved(pool, "other", "served", now) is None  # an adapter it lists
    exc = unserved(pool, "other", None, now)
    assert exc is not None and exc.status == 404 and "'served'" in exc.message
    with pytest.raises(type(exc)):
        check_raw(pool, b'{"model": "other", "prompt": "x"}', now)
    check_raw(pool, b'{"prompt": "x", "model": "other"}', now)  # the parse decides
    with pytest.raises(type(exc)):
        check_parsed(pool, Endpoint.COMPLETIONS, {"model": "other", "prompt": "x"}, now)
    with pytest.raises(MalformedRequest, match="must be a JSON object"):
        check_parsed(pool, Endpoint.COMPLETIONS, [1], now)
    with pytest.raises(MalformedRequest, match="'model' must be a string"):
        check_parsed(pool, Endpoint.COMPLETIONS, {"model": 1}, now)
    check_parsed(pool, Endpoint.GENERATE, {"text": "x"}, now)  # /generate may name none


def test_bearer_auth(monkeypatch):
    monkeypatch.setenv("TOK", "s3cret")
    a = BearerAuth("TOK", "admin")
    a.check("Bearer s3cret")
    for bad in (None, "", "s3cret", "Bearer wrong", "Basic s3cret"):
        with pytest.raises(Unauthorized):
            a.check(bad)
    monkeypatch.delenv("TOK")
    BearerAuth("TOK", "admin").check(None)  # no token configured: open (loopback only)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")


# --------------------------------------------------- upstream response parser


class FakeConn:
    def __init__(self):
        self.closed = False
        self.resp = None
        self.pool = self
        self.put = []

    def close(self):
        self.closed = True

    def _put(self, c):
        self.put.append(c)


def feed_all(data: bytes, sizes) -> tuple[Response, FakeConn]:
    loop = asyncio.get_running_loop()
    conn = FakeConn()
    r = Response(conn, loop, 5.0, loop.time() + 5)
    conn.resp = r
    i = 0
    for n in sizes:
        if i >= len(data):
            break
        r._feed(data[i : i + n])
        i += n
    if i < len(data):
        r._feed(data[i:])
    return r, conn


@pytest.mark.parametrize("seed", range(5))
async def test_parser_chunked_and_length_any_split(seed):
    rng = random.Random(seed)
    payload = b'data: {"x": 1}\n\n' * 7 + b"data: [DONE]\n\n"
    chunked = (
        b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:10], payload[10:57], payload[57:]))
        + b"0\r\n\r\n"
    )
    head = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: text/event-stream\r\n\r\n"
    )
    sizes = [rng.randint(1, 9) for _ in range(200)]
    r, conn = feed_all(head + chunked, sizes)
    await r.wait_head()
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
    assert await r.read() == payload
    r.release()
    assert conn.put == [conn] and not conn.closed
    body = b'{"ok": true}'
    r, conn = feed_all(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), sizes)
    await r.wait_head()
    assert r.status == 201 and await r.read() == body and r._state == _DONE
    r.release()
    assert conn.put == [conn]


async def test_parser_close_framed_and_errors():
    r, conn = feed_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nabc", [100])
    await r.wait_head()
    assert await r.readany() == b"abc"
    r._lost(None)
    assert await r.readany() == b""
    r.release()
    assert conn.closed and conn.put == []  # close-framed: never reused
    r, conn = feed_all(b"garbage\r\n\r\n", [100])
    with pytest.raises(UpstreamBroken, match="not an HTTP response"):
        await r.wait_head()
    r, conn = feed_all(b"", [])
    r._lost(None)
    with pytest.raises(NoAnswer):  # the request went out: the worker may have run it
        await r.wait_head()
    r, conn = feed_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", [100])
    await r.wait_head()
    r._lost(ConnectionResetError())
    with pytest.raises(UpstreamBroken, match="mid-response"):
        await r.read()
    r, conn = feed_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", [100])
    await r.wait_head()
    with pytest.raises(UpstreamBroken, match="bad chunk size"):
        await r.read()


async def test_a_request_that_could_not_be_sent_is_connect_failed():
    """Only a failure before the request went out says the worker never got it."""
    pool = UpstreamPool(connect_timeout_s=1.0)
    port = free_port()  # nobody listens: refused
    with pytest.raises(ConnectFailed, match="cannot connect"):
        await pool.request(
            "127.0.0.1", port, build_head("/x", "h", 0, b""), b"", read_timeout_s=1, total_timeout_s=1
        )
    assert pool.connects == 0 and pool.idle_count() == 0
    await pool.aclose()


async def test_parser_first_byte_timeout():
    loop = asyncio.get_running_loop()
    conn = FakeConn()
    r = Response(conn, loop, 0.05, loop.time() + 5)
    from radixfleet.server.upstream import UpstreamTimeout

    with pytest.raises(UpstreamTimeout, match="no first byte within 0.05s"):
        await r.wait_head()
    assert conn.closed


async def _stream_failure(read_timeout: float, total_timeout: float, limit: float = float("inf")):
    """How a streamed answer that sends one 21-byte event and then nothing fails,
    read with ``readany`` as the relay reads it."""
    loop = asyncio.get_running_loop()
    conn = FakeConn()
    r = Response(conn, loop, read_timeout, loop.time() + total_timeout, limit=limit)
    conn.resp = r
    event = b'data: {"text": "x"}\n\n'
    r._feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
    await r.wait_head()
    with pytest.raises(UpstreamError) as info:
        while True:
            await r.readany()
    assert conn.closed
    return info.value


async def test_only_a_workers_own_failures_count_against_its_breaker():
    """A stream silent past its read timeout (first_byte_s) is the worker's failure:
    three in a row open its breaker. A stream cut by the router's own total deadline
    (timeouts.total_s: a healthy worker streaming a long answer) or size limit is
    not: three in a row leave it closed. (A client that leaves or is dropped is not
    an upstream error at all: ok None, radixfleet.server.attempts.Attempts._relay.)"""
    silent = await _stream_failure(0.02, 5.0)
    deadline = await _stream_failure(5.0, 0.05)
    too_large = await _stream_failure(5.0, 5.0, limit=20)
    assert type(silent) is UpstreamTimeout and "no next bytes within 0.02s" in str(silent)
    assert type(deadline) is DeadlinePassed and deadline.cause == "timeout"  # a 504 before a byte
    assert type(too_large) is ResponseTooLarge
    assert [finish_outcome(e) for e in (silent, deadline, too_large)] == [False, None, None]
    assert finish_outcome(Cancelled("worker turned unhealthy")) is False
    assert finish_outcome(UpstreamBroken("closed mid-response")) is False
    pool, idx, clock = make_pool(breaker={"failure_threshold": 3, "open_s": 5.0})
    a = pool.get("a")
    for exc in (deadline, too_large, deadline, deadline):
        pool.pick(a, 10)
        pool.finish(a, 10, finish_outcome(exc))
    assert a.breaker is Breaker.CLOSED and a.breaker_fails == 0
    for _ in range(3):
        pool.pick(a, 10)
        pool.finish(a, 10, finish_outcome(silent))
    assert a.breaker is Breaker.OPEN
    pool.check()


async def test_parser_refuses_a_body_over_its_limit():
    loop = asyncio.get_running_loop()
    conn = FakeConn()
    r = Response(conn, loop, 5.0, loop.time() + 5, limit=10)
    conn.resp = r
    r._feed(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nabc")
    await r.wait_head()
    with pytest.raises(ResponseTooLarge, match="answer of 11 bytes"):  # before it came
        await r.read()
    assert conn.closed
    conn = FakeConn()
    r = Response(conn, loop, 5.0, loop.time() + 5, limit=10)
    conn.resp = r
    r._feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n")
    assert r._err is None
    r._feed(b"6\r\nghijkl\r\n0\r\n\r\n")  # 12 bytes held: past the limit
    assert isinstance(r._err, ResponseTooLarge) and conn.closed


async def _serve(handle):
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


@pytest.mark.integration
async def test_a_slow_stream_consumer_pauses_the_worker_not_the_memory():
    size = 16 * STREAM_HIGH
    sent = asyncio.Event()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(16):
            writer.write(b"x" * STREAM_HIGH)
            await writer.drain()
        sent.set()
        writer.close()

    srv, port = await _serve(handle)
    pool = UpstreamPool(body_limit=2 * STREAM_HIGH + (1 << 18))  # above what it may hold
    try:
        resp = await pool.request(
            "127.0.0.1", port, build_head("/x", "h", 0, b""), b"", read_timeout_s=5, total_timeout_s=20
        )
        got = len(await resp.readany())
        peak = biggest = 0
        while True:
            await asyncio.sleep(0.02)  # a slow client
            peak = max(peak, resp._held)
            chunk = await resp.readany()
            if not chunk:
                break
            got += len(chunk)
            biggest = max(biggest, len(chunk))
        resp.release()
        assert got == size and sent.is_set()
        # never more than the high-water mark plus one read was held: TCP pushed back;
        # and never more than the mark handed out at once (what a slow client's buffer gets)
        assert peak <= STREAM_HIGH + (1 << 18), peak
        assert biggest == STREAM_HIGH, biggest
    finally:
        await pool.aclose()
        srv.close()
        await srv.wait_closed()


@pytest.mark.integration
async def test_cancel_fails_a_waiting_request_and_closes_its_connection():
    closed = asyncio.Event()

    async def handle(reader, writer):  # takes the request, never answers (a hung worker)
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # returns at EOF: the router closed the connection
        closed.set()
        writer.close()

    srv, port = await _serve(handle)
    pool = UpstreamPool()
    try:
        cancel = Cancel()
        req = asyncio.ensure_future(
            pool.request(
                "127.0.0.1",
                port,
                build_head("/x", "h", 0, b""),
                b"",
                read_timeout_s=float("inf"),
                total_timeout_s=30,
                cancel=cancel,
            )
        )
        await asyncio.sleep(0.1)
        assert not req.done()
        cancel.cancel(Cancelled("worker unhealthy"))
        with pytest.raises(Cancelled, match="worker unhealthy"):
            await asyncio.wait_for(req, 2)
        await asyncio.wait_for(closed.wait(), 2)  # the worker saw its client leave
        cancel = Cancel()
        cancel.cancel(Cancelled("before it was sent"))
        with pytest.raises(Cancelled):
            await pool.request(
                "127.0.0.1",
                port,
                build_head("/x", "h", 0, b""),
                b"",
                read_timeout_s=1,
                total_timeout_s=1,
                cancel=cancel,
            )
        assert pool.idle_count() == 0
    finally:
        await pool.aclose()
        srv.close()
        await srv.wait_closed()


# ------------------------------------------------------- randomized pool stress


@pytest.mark.parametrize("seed", range(3))
def test_pool_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    pool, idx, clock = make_pool(breaker={"failure_threshold": 2, "open_s": 1.0})
    held: list = []  # (worker, tokens still counted, prefilled?)
    next_port = 10
    for _step in range(600):
        clock.t += rng.random() * 0.1
        op = rng.random()
        views = pool.views(clock())
        if op < 0.35 and views:
            w = pool.get(views[rng.randrange(len(views))].id)
            toks = rng.randrange(0, 500)
            pool.pick(w, toks)
            idx.insert(w.id, [rng.randrange(1, 50) for _ in range(1)], clock())
            held.append([w, toks])
        elif op < 0.45 and held:
            h = held[rng.randrange(len(held))]
            pool.prefilled(h[0], h[1])
            h[1] = 0
        elif op < 0.7 and held:
            w, toks = held.pop(rng.randrange(len(held)))
            pool.finish(w, toks, rng.choice([True, False, None]))
        elif op < 0.8:
            ws = list(pool)
            if ws:
                w = rng.choice(ws)
                pool._set_health(w, rng.choice([HealthState.HEALTHY, HealthState.UNHEALTHY]))
        elif op < 0.85 and len(pool) > 1:
            pool.remove(rng.choice(list(pool)).id)
        elif op < 0.9:
            next_port += 1
            w = pool.add(f"n{next_port}", f"http://127.0.0.1:{next_port}", Source.ADMIN)
            pool._set_health(w, HealthState.HEALTHY)
        elif op < 0.95:
            ws = list(pool)
            if ws:
                pool.drain(rng.choice(ws).id, rng.random() < 0.5)
        else:
            ws = list(pool)
            if ws:
                pool.report_load(rng.choice(ws), Load(queued_tokens=rng.randrange(100)), clock())
        pool.check()
        idx.check()
        for v in pool.views(clock()):
            w = pool.get(v.id)
            assert w.routable(clock()) and v.in_flight == w.in_flight
            assert v.in_flight_tokens == w.in_flight_tokens
    for w, toks in held:
        pool.finish(w, toks, None)
    assert all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in pool)


def test_models_list_claims_the_smallest_context_every_worker_reported():
    """``/v1/models``' ``max_model_len`` is one every worker of the model accepts, and
    absent when a worker reported none (an agent, a worker that did not answer)."""
    from radixfleet.server.app import merge_models

    vllm = [{"id": "m", "object": "model", "max_model_len": 4096}]
    short = [{"id": "m", "object": "model", "max_model_len": 2048}]
    agent = [{"id": "m", "object": "model"}, {"id": "a", "object": "model"}]
    assert merge_models([vllm, short]) == [{"id": "m", "object": "model", "max_model_len": 2048}]
    assert merge_models([vllm, agent]) == [
        {"id": "a", "object": "model"},
        {"id": "m", "object": "model"},
    ]
    assert merge_models([vllm]) == vllm and vllm[0]["max_model_len"] == 4096  # input untouched


def test_the_router_process_runs_with_the_index_collector_thresholds(monkeypatch):
    """``radixfleet router`` raises the cyclic collector's thresholds before serving
    (``radixfleet.index.prefix_index.tune_gc``): with the defaults the collector rescans every
    index node as the index grows (bench/RESULTS.md "Routing work")."""
    import argparse
    import gc

    import radixfleet.server.cli as rcli

    seen = {}

    async def serve(cfg, overrides, ready=None):
        seen["threshold"] = gc.get_threshold()
        return 0

    monkeypatch.setattr(rcli, "serve", serve)
    parser = argparse.ArgumentParser()
    rcli.configure(parser)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # the interpreter's defaults
        assert rcli.run(parser.parse_args(["--worker", "http://127.0.0.1:9"])) == 0
    finally:
        gc.set_threshold(*before)
    assert seen["threshold"][0] >= 100_000, seen
