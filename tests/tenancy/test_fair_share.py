"""radixfleet.route.fair_share: which tenants got less than their weighted share of what was
admitted lately, and radixfleet.route.tenancy shedding their requests as the next class up."""

from __future__ import annotations

import math
import random

from radixfleet.config import parse_config
from radixfleet.route.fair_share import FairShare
from radixfleet.route.tenancy import Tenancy
from radixfleet.server.metrics import Metrics


def feed(fs: FairShare, rates: dict[str, float], t0: float, seconds: float, step: float = 0.1) -> float:
    """Tokens per second per tenant, admitted every ``step`` s; returns the end time."""
    t = t0
    while t < t0 + seconds:
        for tenant, rate in rates.items():
            fs.served(tenant, rate * step, t)
        t += step
    fs.check()
    return t


def test_a_tenant_alone_is_never_under_its_share():
    fs = FairShare(10.0, 0.8, {})
    assert not fs.is_under("a", 0.0)  # nothing admitted yet: nobody is under
    t = feed(fs, {"a": 1000.0}, 0.0, 30.0)
    assert not fs.is_under("a", t)
    assert not fs.is_under("a", t + 1000.0)  # and long after


def test_the_light_tenant_next_to_a_heavy_one_is_under_and_the_heavy_one_is_not():
    fs = FairShare(10.0, 0.8, {})
    t = feed(fs, {"a": 5000.0, "b": 500.0}, 0.0, 30.0)
    assert fs.is_under("b", t) and not fs.is_under("a", t)
    # a tenant nothing was admitted for yet shares the fleet too
    assert fs.is_under("newcomer", t)


def test_equal_tenants_sit_within_the_margin_and_neither_is_under():
    fs = FairShare(10.0, 0.8, {})
    rng = random.Random(1)
    t, under = 0.0, 0
    while t < 60.0:
        tenant = "a" if rng.random() < 0.5 else "b"
        fs.served(tenant, 1000, t)
        under += fs.is_under(tenant, t)
        t += 0.05
    fs.check()
    assert under < 0.02 * (60 / 0.05), under


def test_weights_set_the_share():
    rates = {"a": 700.0, "b": 300.0}
    even = FairShare(10.0, 0.8, {})
    t = feed(even, rates, 0.0, 30.0)
    assert even.is_under("b", t)  # 0.3 < 0.8 * 0.5
    weighted = FairShare(10.0, 0.8, {"a": 3.0})
    t = feed(weighted, rates, 0.0, 30.0)
    assert not weighted.is_under("b", t) and not weighted.is_under("a", t)  # 0.3 >= 0.8 * 0.25


def test_service_decays_and_idle_tenants_are_forgotten():
    fs = FairShare(2.0, 0.8, {})
    t = feed(fs, {"a": 1000.0, "b": 1000.0}, 0.0, 10.0)
    t = feed(fs, {"a": 1000.0}, t, 40.0)  # b idle for 20 half-lives
    assert not fs.is_under("a", t)  # b no longer shares the fleet: a is alone
    assert "b" not in fs._served  # forgotten at a refresh


def test_a_correction_never_takes_a_tenant_below_zero_and_off_is_never_under():
    fs = FairShare(10.0, 0.8, {})
    fs.served("a", 100, 0.0)
    fs.served("a", -1_000_000, 0.1)
    fs.served("b", 100, 0.2)
    fs.check()
    assert fs._served["a"][0] == 0.0 and math.isclose(fs._total, 100.0)
    off = FairShare(10.0, 0.0, {})
    t = feed(off, {"a": 5000.0, "b": 1.0}, 0.0, 5.0)
    assert not off.is_under("b", t)


def tenancy(fair_share: dict | None = None, **more) -> tuple[Tenancy, Metrics]:
    raw = {
        "tenancy": {
            "default_priority": "standard",
            **({"fair_share": fair_share} if fair_share else {}),
            **more,
        }
    }
    m = Metrics()
    return Tenancy(parse_config(raw).tenancy, [], m, 0.0), m


def heavy_and_light(t: Tenancy, seconds: float) -> tuple[object, float]:
    """a at ten times b's rate, every 0.1 s for ``seconds``: b's last ticket, the time."""
    now, ticket = 0.0, None
    for i in range(int(seconds * 10)):
        now = i * 0.1
        for _ in range(10):
            t.admitted(t.admit("a", "", "m", {}, 1000, {}, now), now)
        ticket = t.admit("b", "", "m", {}, 1000, {}, now)
        t.admitted(ticket, now)
    return ticket, now


def test_a_tenant_under_its_share_is_shed_as_the_next_class_and_counted_under_its_own():
    t, m = tenancy()
    ticket, now = heavy_and_light(t, 30.0)
    # critical's factor; its band and engine priority stay standard's
    assert ticket.priority == "standard" and ticket.rank == 1 and ticket.scale == 4.0
    heavy = t.admit("a", "", "m", {}, 1000, {}, now)
    assert heavy.rank == 1 and heavy.scale == 1.0
    claim = t.admit("b", "", "m", {"x-radixfleet-priority": "sheddable"}, 1000, {}, now)
    # standard's factor: shed no sooner than a standard request, never later
    assert claim.priority == "sheddable" and claim.rank == 2 and claim.scale == 1.0
    promoted = m.registry.get_sample_value("radixfleet_tenant_promoted_total", {"tenant": "b"})
    assert promoted and promoted >= 290
    assert not m.registry.get_sample_value("radixfleet_tenant_promoted_total", {"tenant": "a"})
    admitted = m.registry.get_sample_value(
        "radixfleet_tenant_requests_total", {"tenant": "b", "priority": "standard", "outcome": "admitted"}
    )
    assert admitted == 300


def test_fair_share_off_keeps_every_class():
    t, _ = tenancy({"under": 0})
    ticket, _ = heavy_and_light(t, 10.0)
    assert ticket.rank == 1 and ticket.scale == 1.0


def test_critical_has_no_class_above_it():
    t, m = tenancy(tenants={"b": {"priority": "critical"}})
    ticket, _ = heavy_and_light(t, 10.0)
    assert ticket.priority == "critical" and ticket.rank == 0 and ticket.scale == 4.0
    assert not m.registry.get_sample_value("radixfleet_tenant_promoted_total", {"tenant": "b"})


def test_a_clock_reading_older_than_the_last_decays_nothing_twice():
    """Requests admitted concurrently pass the times they read, not in order."""
    fs = FairShare(10.0, 0.8, {})
    fs.served("a", 1000, 5.0)
    fs.served("b", 10, 4.0)  # read before a's, admitted after it
    fs.served("a", 1000, 6.0)
    fs.check()
    assert fs._total_at == 6.0 and fs._served["b"][1] == 4.0
    assert math.isclose(fs._total, 1000 * 0.5**0.1 + 10 * 0.5**0.1 + 1000, rel_tol=1e-9)


def test_a_body_asking_for_more_tokens_than_a_float_holds_counts_at_the_cap():
    """A client's max_tokens is any JSON integer (a fuzzed body sent 10**150): the
    router must not fail on it (it answered 500 once)."""
    fs = FairShare(10.0, 0.8, {})
    fs.served("a", 10**400, 0.0)
    fs.served("a", -(10**400), 0.5)
    fs.served("b", 10**400, 1.0)
    fs.check()
    assert fs.is_under("a", 1.0) and not fs.is_under("b", 1.0)
    t, _ = tenancy()
    ticket = t.admit("a", "", "m", {}, 10, {"max_tokens": 10**150}, 0.0)
    t.admitted(ticket, 0.0)
    t.settle(ticket, 20, 0.5)
    t.fair.check()
