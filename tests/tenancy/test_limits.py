"""Priority classes and rate limits per tenant and API key (radixfleet.route.tenancy,
radixfleet.route.rate_limit): token buckets keep their invariants and answer exactly when a
request could pass; a tenant over its limit is refused with the x-ratelimit-*
headers while another is served; a shed request gets its reservation back and an
answer's usage corrects it; classes come from the key, the tenant, the model or an
allowed header (a claim above the key's ceiling gets the key's class, counted); the
shedder admits a higher class whenever it would admit a lower one; the YAML's bad
class names, weights and limits are refused with their paths (at start, by
check-config and at reload)."""

from __future__ import annotations

import random
import subprocess

import pytest

from radixfleet.config import load_config, parse_config
from radixfleet.route.rate_limit import TokenBucket, duration
from radixfleet.route.shedding import Shedder
from radixfleet.route.tenancy import OTHER, Tenancy, TenantLabels
from radixfleet.server.app import Router
from radixfleet.server.metrics import Metrics
from radixfleet.wire.errors import ConfigError, MalformedRequest, RateLimited
from radixfleet.wire.events import Load
from radixfleet_tools.harness.procs import radixfleet_argv
from tests.router.pools import make_pool

# -- the token bucket -------------------------------------------------------------------


def test_a_bucket_passes_its_burst_then_its_rate_and_says_when():
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    for _ in range(3):
        assert b.wait_s(1, 0.0) == 0.0
        b.take(1)
        b.check()
    assert b.remaining() == 0
    assert b.wait_s(1, 0.0) == pytest.approx(0.5)  # one unit at 2/s
    assert b.reset_s() == pytest.approx(1.5)
    assert b.wait_s(1, 0.25) == pytest.approx(0.25)
    assert b.wait_s(1, 0.5) == 0.0
    b.take(1)
    assert b.wait_s(1, 100.0) == 0.0 and b.remaining() == 3  # refilled to the burst, no more
    b.check()


def test_a_cost_above_the_burst_passes_only_full_and_leaves_debt_of_one_burst_at_most():
    b = TokenBucket(rate=10.0, burst=100, now=0.0)
    b.take(10)
    assert b.wait_s(500, 0.0) == pytest.approx(1.0)  # waits for a full bucket, not for 500
    assert b.wait_s(500, 1.0) == 0.0
    b.take(500)
    assert b.level == -100 and b.remaining() == 0  # 400 short: the debt stops at one burst
    b.check()
    assert b.wait_s(1, 1.0) == pytest.approx(10.1)  # the debt is paid first
    b.give(150, 1.0)  # the answer used less than reserved
    assert b.level == pytest.approx(50)
    b.give(-30, 1.0)  # or more than reserved: charged
    assert b.level == pytest.approx(20)
    b.give(-(10**9), 1.0)  # a charge far above the burst (usage, a peer's report)
    assert b.level == -100 and b.reset_s() == pytest.approx(20.0)
    b.give(10**6, 1.0)
    assert b.level == 100  # never above the burst
    b.reconfigure(10.0, 40, 1.0)
    b.give(-(10**6), 1.0)
    assert b.level == -40  # a smaller burst caps the debt at it
    b.check()


def test_random_takes_gives_and_reloads_keep_the_bucket_consistent():
    rng = random.Random(11)
    b = TokenBucket(rate=5.0, burst=20, now=0.0)
    now = 0.0
    for _ in range(3000):
        now += rng.choice((0.0, 0.001, 0.05, 0.5))
        op = rng.random()
        if op < 0.6:
            cost = rng.randint(1, 40)
            if b.wait_s(cost, now) == 0.0:
                b.take(cost)
        elif op < 0.9:
            b.give(rng.randint(-300, 30), now)
        else:
            b.reconfigure(rng.choice((1.0, 5.0, 50.0)), rng.choice((1, 20, 200)), now)
        b.check()
        assert b.wait_s(1, now) >= 0.0 and b.reset_s() >= 0.0


def test_reset_times_are_written_as_openai_writes_them():
    assert [duration(s) for s in (0.0, 0.0201, 0.5, 1.0, 1.2, 59.5, 360.0, 3723.0)] == [
        "0ms",
        "21ms",
        "500ms",
        "1s",
        "2s",
        "1m0s",
        "6m0s",
        "1h2m3s",
    ]


# -- limits and classes -------------------------------------------------------------------


def tenancy(raw: dict, keys: dict | None = None) -> tuple[Tenancy, Metrics]:
    cfg = parse_config({"tenancy": raw, **({"keys": keys} if keys else {})})
    m = Metrics()
    return Tenancy(cfg.tenancy, ["acme", "zeta"], m, 0.0), m


def count(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_a_tenant_over_its_request_rate_gets_429_with_headers_while_another_is_served():
    t, m = tenancy({"tenants": {"acme": {"requests_per_s": 2, "request_burst": 2}}})
    for _ in range(2):
        t.admitted(t.admit("acme", "", "m", {}, 10, {}, 0.0), 0.0)
    with pytest.raises(RateLimited) as ei:
        t.admit("acme", "", "m", {}, 10, {}, 0.1)
    exc = ei.value
    assert exc.status == 429 and exc.code == "rate_limit_exceeded"
    assert exc.retry_after_s == pytest.approx(0.4)
    assert dict(exc.headers) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "900ms",
    }
    assert exc.to_json()["error"]["type"] == "rate_limit_error"
    assert "tenant acme is over its rate limit of 2 requests/s (burst 2)" in exc.message
    for _ in range(50):  # zeta has no limit
        t.admitted(t.admit("zeta", "", "m", {}, 10, {}, 0.1), 0.1)
    t.admit("acme", "", "m", {}, 10, {}, 0.5)  # refilled
    lab = {"priority": "standard"}
    assert count(m, "radixfleet_tenant_requests_total", tenant="acme", outcome="limited", **lab) == 1
    assert count(m, "radixfleet_tenant_requests_total", tenant="acme", outcome="admitted", **lab) == 2
    assert count(m, "radixfleet_tenant_requests_total", tenant="zeta", outcome="admitted", **lab) == 50


def test_a_spent_bucket_refuses_from_the_head_whatever_the_body_and_takes_nothing():
    t, m = tenancy(
        {
            "tenants": {
                "acme": {"requests_per_s": 1, "request_burst": 2},
                "tok": {"tokens_per_min": 60, "token_burst": 100, "priority": "critical"},
            }
        }
    )
    assert t.over_limit("acme", "", 0.0) is None and t.over_limit("zeta", "", 0.0) is None
    for _ in range(2):
        t.admitted(t.admit("acme", "", "m", {}, 10, {}, 0.0), 0.0)
    exc = t.over_limit("acme", "", 0.25)
    assert exc is not None and exc.status == 429 and exc.retry_after_s == pytest.approx(0.75)
    assert dict(exc.headers)["x-ratelimit-remaining-requests"] == "0"
    assert "1 request and at least 1 token;" in exc.message
    assert t.over_limit("acme", "", 1.0) is None  # refilled: nothing was taken
    t.admit("acme", "", "m", {}, 10, {}, 1.0)
    # a spent token bucket refuses any next body until a token is back
    t.admitted(t.admit("tok", "", "m", {}, 100, {}, 0.0), 0.0)
    refused = t.over_limit("tok", "", 0.25)  # 0.25 tokens back at 1/s: short of 1
    assert refused is not None and refused.retry_after_s == pytest.approx(0.75)
    assert t.over_limit("tok", "", 1.0) is None
    lab = {"outcome": "limited"}
    assert count(m, "radixfleet_tenant_requests_total", tenant="acme", priority="standard", **lab) == 1
    assert count(m, "radixfleet_tenant_requests_total", tenant="tok", priority="critical", **lab) == 1


def test_tokens_reserve_prompt_and_max_tokens_are_refunded_when_shed_and_corrected_by_usage():
    t, _ = tenancy({"tenants": {"acme": {"tokens_per_min": 6000, "token_burst": 1000}}})
    a = t.admit("acme", "", "m", {}, 300, {"max_tokens": 500}, 0.0)
    assert a.reserved == 800
    with pytest.raises(RateLimited) as ei:  # 200 left, 800 asked: 600 tokens at 100/s
        t.admit("acme", "", "m", {}, 300, {"max_completion_tokens": 500}, 0.0)
    assert ei.value.retry_after_s == pytest.approx(6.0)
    h = dict(ei.value.headers)
    assert h["x-ratelimit-limit-tokens"] == "1000" and h["x-ratelimit-remaining-tokens"] == "200"
    assert h["x-ratelimit-reset-tokens"] == "8s"
    t.shed(a, 0.0)  # shed: all 800 back
    b = t.admit("acme", "", "m", {}, 300, {"max_tokens": 500}, 0.0)
    t.settle(b, 350, 0.0)  # the answer used 300 + 50: 450 back
    t.settle(b, 0, 0.0)  # once only
    lim = b.limits[0]
    assert lim.tokens.level == pytest.approx(650)
    assert lim.requests is None  # no request limit configured
    with pytest.raises(RateLimited):
        t.admit("acme", "", "m", {}, 600, {"max_tokens": 100}, 0.0)


def test_a_key_limit_and_a_tenant_limit_both_hold_and_nothing_is_taken_from_either_on_refusal():
    keys = {
        "tenant": {
            "source": "api_key",
            "api_keys": [
                {"tenant": "acme", "key": "k1", "name": "acme-batch"},
                {"tenant": "acme", "key": "k2", "name": "acme-chat"},
            ],
        }
    }
    t, _ = tenancy(
        {
            "tenants": {"acme": {"requests_per_s": 1, "request_burst": 3}},
            "keys": {"acme-batch": {"requests_per_s": 1, "request_burst": 1}},
        },
        keys,
    )
    first = t.admit("acme", "acme-batch", "m", {}, 1, {}, 0.0)
    # the admitted answer's headers: the tighter of the two limits (the key's, 0 left)
    assert dict(first.headers()) == {
        "x-ratelimit-limit-requests": "1",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1s",
    }
    assert t.admit("zeta", "", "m", {}, 1, {}, 0.0).headers() == ()  # no limits: none
    with pytest.raises(RateLimited) as ei:
        t.admit("acme", "acme-batch", "m", {}, 1, {}, 0.0)
    assert "API key acme-batch is over" in ei.value.message
    # the refusal took nothing from the tenant: its other key still has 2 of 3
    t.admit("acme", "acme-chat", "m", {}, 1, {}, 0.0)
    t.admit("acme", "acme-chat", "m", {}, 1, {}, 0.0)
    with pytest.raises(RateLimited) as ei:
        t.admit("acme", "acme-chat", "m", {}, 1, {}, 0.0)
    assert "tenant acme is over" in ei.value.message


def test_a_reload_keeps_what_a_tenant_used():
    t, _ = tenancy({"tenants": {"acme": {"requests_per_s": 1, "request_burst": 2}}})
    t.admit("acme", "", "m", {}, 1, {}, 0.0)
    t.admit("acme", "", "m", {}, 1, {}, 0.0)
    cfg = parse_config({"tenancy": {"tenants": {"acme": {"requests_per_s": 1, "request_burst": 5}}}})
    t.configure(cfg.tenancy, [], 0.0)
    for _ in range(3):  # the new burst, less the 2 used
        t.admit("acme", "", "m", {}, 1, {}, 0.0)
    with pytest.raises(RateLimited):
        t.admit("acme", "", "m", {}, 1, {}, 0.0)


def test_the_class_comes_from_the_key_the_tenant_the_model_or_the_default():
    keys = {"tenant": {"source": "api_key", "api_keys": [{"tenant": "acme", "key": "k", "name": "kb"}]}}
    t, _ = tenancy(
        {
            "default_priority": "standard",
            "models": {"batch-model": "sheddable"},
            "tenants": {"acme": {"priority": "critical"}},
            "keys": {"kb": {"priority": "sheddable"}},
        },
        keys,
    )
    assert t.admit("acme", "kb", "m", {}, 1, {}, 0.0).priority == "sheddable"
    assert t.admit("acme", "", "m", {}, 1, {}, 0.0).priority == "critical"
    assert t.admit("zeta", "", "batch-model", {}, 1, {}, 0.0).priority == "sheddable"
    z = t.admit("zeta", "", "m", {}, 1, {}, 0.0)
    assert (z.priority, z.scale) == ("standard", 1.0)


def test_a_header_may_lower_the_class_and_raise_it_only_to_the_ceiling():
    t, m = tenancy(
        {
            "tenants": {
                "acme": {"priority": "standard", "max_priority": "critical"},
                "zeta": {"priority": "standard"},
            },
            "queue_scale": {"critical": 3, "standard": 1, "sheddable": 0.5},
        }
    )
    h = "x-radixfleet-priority"
    a = t.admit("acme", "", "m", {h: "critical"}, 1, {}, 0.0)
    assert (a.priority, a.scale) == ("critical", 3.0)
    z = t.admit("zeta", "", "m", {h: " Sheddable"}, 1, {}, 0.0)
    assert (z.priority, z.scale) == ("sheddable", 0.5)
    assert t.admit("zeta", "", "m", {h: "critical"}, 1, {}, 0.0).priority == "standard"
    assert count(m, "radixfleet_priority_claims_refused_total", tenant="zeta") == 1
    assert count(m, "radixfleet_priority_claims_refused_total", tenant="acme") == 0
    with pytest.raises(MalformedRequest, match="x-radixfleet-priority: 'vip' is not one of critical"):
        t.admit("zeta", "", "m", {h: "vip"}, 1, {}, 0.0)
    off, _ = tenancy({"priority_header": ""})
    assert off.admit("zeta", "", "m", {h: "vip"}, 1, {}, 0.0).priority == "standard"


def test_tenants_past_top_n_are_counted_as_other_and_labels_never_move():
    labels = TenantLabels(3)
    labels.name(["acme", "zeta"])
    assert [labels.label(x) for x in ("new1", "new2", "acme", "new1", "")] == [
        "new1",
        OTHER,
        "acme",
        "new1",
        OTHER,
    ]
    labels.check()
    t, m = tenancy({"top_n": 2})
    for i in range(10):
        t.admitted(t.admit(f"t{i}", "", "m", {}, 1, {}, 0.0), 0.0)
    lab = {"priority": "standard", "outcome": "admitted"}
    assert count(m, "radixfleet_tenant_requests_total", tenant=OTHER, **lab) == 10
    assert count(m, "radixfleet_tenant_requests_total", tenant="acme", **lab) == 0


# -- the class's hook into shedding --------------------------------------------------------


def test_the_shedder_admits_a_higher_class_whenever_it_admits_a_lower_one():
    """At random loads, a larger bound factor never sheds what a smaller one admits;
    at a queue between the sheddable and critical bounds only sheddable is shed."""
    rng = random.Random(5)
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05)
    t = clock()
    decisions = {0.25: 0, 1.0: 0, 4.0: 0}
    for _ in range(600):
        for w in pool:
            for _ in range(rng.choice((1, 2))):
                pool.report_load(
                    w,
                    Load(
                        queued_requests=rng.randint(0, 6),
                        queued_tokens=rng.randint(0, 3000),
                        running_requests=rng.randint(0, 8),
                        prefill_tokens_per_s=1000.0,
                    ),
                    t,
                    stale_s=5.0,
                    engine=rng.random() < 0.5,
                )
        typical, largest = rng.uniform(0.05, 2.0), rng.uniform(0, 2000)
        shed = {}
        for scale in decisions:
            s.typical_s, s.largest_tokens = typical, largest
            shed[scale] = s.check(pool.routable_workers(t), "m", None, 100, t, scale) is not None
            decisions[scale] += shed[scale]
        assert shed[4.0] <= shed[1.0] <= shed[0.25], shed
    assert decisions[0.25] > decisions[1.0] > decisions[4.0] >= 0, decisions


# -- the YAML ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "path", "says"),
    [
        ({"default_priority": "gold"}, "tenancy.default_priority", "'gold' is not one of critical"),
        ({"models": {"m": "urgent"}}, "tenancy.models.m", "'urgent' is not one of critical"),
        ({"tenants": {"a": {"priority": "vip"}}}, "tenancy.tenants.a.priority", "'vip' is not one of"),
        (
            {"queue_scale": {"sheddable": 0}},
            "tenancy.queue_scale.sheddable",
            "expected a number in (0, 1000]",
        ),
        ({"queue_scale": {"critical": -1.0}}, "tenancy.queue_scale.critical", "expected a number in (0"),
        ({"queue_scale": {"standard": 5}}, "tenancy.queue_scale", "critical >= standard >= sheddable"),
        (
            {"tenants": {"a": {"requests_per_s": "10/s"}}},
            "tenancy.tenants.a.requests_per_s",
            "expected a number",
        ),
        (
            {"tenants": {"a": {"tokens_per_min": -5}}},
            "tenancy.tenants.a.tokens_per_min",
            "expected a number >= 0",
        ),
        (
            {"tenants": {"a": {"request_burst": 1.5}}},
            "tenancy.tenants.a.request_burst",
            "expected an integer",
        ),
        ({"tenants": {"a": {"token_burst": 100}}}, "tenancy.tenants.a.token_burst", "needs tokens_per_min"),
        (
            {"tenants": {"a": {"priority": "sheddable", "max_priority": "sheddable", "rps": 1}}},
            "tenancy.tenants.a.rps",
            "unknown key",
        ),
        (
            {"tenants": {"a": {"priority": "critical", "max_priority": "standard"}}},
            "tenancy.tenants.a.max_priority",
            "below its own class",
        ),
        ({"priority_header": "X Priority"}, "tenancy.priority_header", "lower-case HTTP header name"),
        (
            {"keys": {"nope": {"priority": "critical"}}},
            "tenancy.keys.nope",
            "need keys.tenant.source: api_key",
        ),
    ],
)
def test_bad_tenancy_settings_are_refused_with_their_path(raw, path, says):
    with pytest.raises(ConfigError) as ei:
        parse_config({"tenancy": raw})
    assert [e.path for e in ei.value.errors] == [path], str(ei.value)
    assert says in str(ei.value)


def test_per_key_rules_need_a_named_key():
    keys = {"tenant": {"source": "api_key", "api_keys": [{"tenant": "a", "key": "k", "name": "ka"}]}}
    with pytest.raises(ConfigError, match=r"tenancy.keys.kb: no API key has this name; named: ka"):
        parse_config({"keys": keys, "tenancy": {"keys": {"kb": {"priority": "critical"}}}})
    twice = {
        "tenant": {
            "source": "api_key",
            "api_keys": [
                {"tenant": "a", "key": "k", "name": "ka"},
                {"tenant": "b", "key": "j", "name": "ka"},
            ],
        }
    }
    with pytest.raises(ConfigError, match=r"keys.tenant.api_keys\[1\].name: 'ka' is already"):
        parse_config({"keys": twice})


BAD = "tenancy:\n  tenants:\n    acme: {priority: gold}\n"


@pytest.mark.integration
def test_check_config_refuses_an_unknown_class_with_its_path(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(BAD)
    r = subprocess.run(radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert (
        "tenancy.tenants.acme.priority: 'gold' is not one of \"\", critical, standard, sheddable" in r.stderr
    )


async def test_a_reload_with_an_unknown_class_keeps_the_running_config(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text("reload: {watch: false}\ntenancy:\n  tenants:\n    acme: {requests_per_s: 1}\n")
    router = Router(load_config(str(p)))
    before = router.cfg
    p.write_text("reload: {watch: false}\n" + BAD)
    ok, msg, _, _ = await router.reload()
    assert not ok and "tenancy.tenants.acme.priority" in msg, msg
    assert router.cfg is before and router.dataplane.tenancy.cfg is before.tenancy
