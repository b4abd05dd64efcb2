"""Token limits charged on what the engine does (radixfleet.route.tenancy, "Charged on what the
engine does"): the output bound is the field each endpoint's engines obey, in every
spelling a client may send; the fair share counts the same cost; a stream cut off
is charged what it relayed (the engine's own count when one was seen), never less
than its reservation; a worker's 4xx gives the tokens back; a request above a burst
is refused, and a charge after admission leaves one burst of debt at most."""

from __future__ import annotations

import json

import pytest

from radixfleet.config import parse_config
from radixfleet.keys import Endpoint
from radixfleet.route.tenancy import Tenancy, output_bound
from radixfleet.server.metrics import Metrics
from radixfleet.server.sse import StreamWatch
from radixfleet.wire.errors import OverBurst, RateLimited

CHAT, COMPLETIONS, GENERATE = Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.GENERATE


def tenancy(**rules) -> tuple[Tenancy, Metrics]:
    cfg = parse_config({"tenancy": {"tenants": {"acme": rules, "zeta": {}}}})
    m = Metrics()
    return Tenancy(cfg.tenancy, [], m, 0.0), m


def level(t: Tenancy, tenant: str = "acme") -> float:
    return t._tenants[tenant][1].tokens.level


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = ev({"choices": [{"index": 0, "delta": {"content": "x"}}]})


def usage(prompt: int, completion: int) -> bytes:
    u = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    return ev({"choices": [], "usage": u})


# -- the output bound, per endpoint and spelling ------------------------------------------


@pytest.mark.parametrize(
    "endpoint, body, bound",
    [
        # chat: max_completion_tokens supersedes max_tokens whenever it is a count
        (CHAT, {"max_tokens": 1, "max_completion_tokens": 2000}, (2000, "max_completion_tokens")),
        (CHAT, {"max_tokens": 15000}, (15000, "max_tokens")),
        (CHAT, {"max_completion_tokens": 300}, (300, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": None, "max_tokens": 7}, (7, "max_tokens")),
        (CHAT, {"max_completion_tokens": 0, "max_tokens": 7}, (7, "max_tokens")),  # vLLM's `or`
        # what the engines' pydantic models take for an integer
        (CHAT, {"max_completion_tokens": "2000"}, (2000, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": " +2000 "}, (2000, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": 2000.0}, (2000, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": 1.5}, (2, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": True}, (1, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": "9" * 40}, (10**30, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": 10**150}, (10**150, "max_completion_tokens")),
        (CHAT, {"max_completion_tokens": -5, "max_tokens": "abc"}, (0, "")),
        (CHAT, {"max_completion_tokens": [], "max_tokens": {}}, (0, "")),
        (CHAT, {"max_completion_tokens": "٣"}, (0, "")),  # a non-ASCII digit: no engine's count
        (CHAT, {}, (0, "")),
        # completions: max_tokens only (the API has no other)
        (COMPLETIONS, {"max_tokens": 1, "max_completion_tokens": 2000}, (1, "max_tokens")),
        (COMPLETIONS, {"max_tokens": "64"}, (64, "max_tokens")),
        (COMPLETIONS, {"max_completion_tokens": 2000}, (0, "")),
        # SGLang's /generate: sampling_params.max_new_tokens only
        (
            GENERATE,
            {"sampling_params": {"max_new_tokens": 300}, "max_tokens": 1},
            (300, "sampling_params.max_new_tokens"),
        ),
        (GENERATE, {"sampling_params": {"max_new_tokens": "300"}}, (300, "sampling_params.max_new_tokens")),
        (GENERATE, {"max_tokens": 300, "max_completion_tokens": 300}, (0, "")),
        (GENERATE, {"sampling_params": [{"max_new_tokens": 300}]}, (0, "")),
        (GENERATE, {"sampling_params": None}, (0, "")),
    ],
)
def test_the_output_bound_is_the_field_the_endpoints_engines_obey(endpoint, body, bound):
    assert output_bound(endpoint, body) == bound


@pytest.mark.parametrize(
    "endpoint, body, reserved",
    [
        (CHAT, {"max_tokens": 1, "max_completion_tokens": 2000}, 2012),
        (COMPLETIONS, {"max_tokens": 1, "max_completion_tokens": 2000}, 13),
        (GENERATE, {"sampling_params": {"max_new_tokens": 2000}}, 2012),
        (GENERATE, {"max_tokens": 2000}, 12),  # no bound: the prompt alone, as before
    ],
)
def test_admission_reserves_the_prompt_and_the_bound_the_endpoint_obeys(endpoint, body, reserved):
    t, _ = tenancy(tokens_per_min=60000)
    ticket = t.admit("acme", "", "m", {}, 12, body, 0.0, endpoint)
    assert ticket.reserved == reserved and ticket.prompt == 12
    assert level(t) == 60000 - reserved


def test_max_completion_tokens_is_charged_over_max_tokens_and_the_limit_holds():
    """60,000 tokens/min; chat with max_tokens 1 and max_completion_tokens 2000 (12
    prompt tokens), cut off at 1,995 tokens: 29 are admitted at once, not 60, and
    each stays charged its bound (its stream showed no count of its own)."""
    t, _ = tenancy(tokens_per_min=60000)
    body = {"max_tokens": 1, "max_completion_tokens": 2000, "stream": True}
    admitted = 0
    for _ in range(60):
        try:
            ticket = t.admit("acme", "", "m", {}, 12, body, 0.0, CHAT)
        except RateLimited:
            continue
        admitted += 1
        t.admitted(ticket, 0.0)
        w = StreamWatch(strip_usage=True)
        w.feed(ROLE + TOKEN * 1995)  # the client hangs up here: no usage seen
        t.charge(ticket, None, None, None, w, 0.0)
        assert ticket.open  # it told nothing below its reservation
    assert admitted == 29
    assert level(t) == pytest.approx(60000 - 29 * 2012)


def test_the_fair_share_counts_the_same_bound():
    """b asks for max_tokens 1 and max_completion_tokens 2000, a for max_tokens 1000:
    b is the heavy tenant (it was the light one while max_tokens was read)."""
    t, _ = tenancy()
    for i in range(20):
        now = i * 0.1
        t.admitted(t.admit("a", "", "m", {}, 10, {"max_tokens": 1000}, now, CHAT), now)
        t.admitted(
            t.admit("b", "", "m", {}, 10, {"max_tokens": 1, "max_completion_tokens": 2000}, now, CHAT), now
        )
    assert t.fair.is_under("a", 2.0) and not t.fair.is_under("b", 2.0)
    t.fair.check()


# -- charged on what the engine did --------------------------------------------------------


def test_an_unbounded_stream_cut_off_is_charged_the_events_it_relayed():
    t, _ = tenancy(tokens_per_min=60000)
    ticket = t.admit("acme", "", "m", {}, 100, {"stream": True}, 0.0, CHAT)
    assert ticket.reserved == 100  # no bound: the prompt alone
    t.admitted(ticket, 0.0)
    w = StreamWatch(strip_usage=True)
    w.feed(ROLE)
    w.feed(TOKEN * 40)
    w.feed(TOKEN * 10 + TOKEN[:9])  # the client leaves mid-event
    assert w.output_events == 50
    t.charge(ticket, None, None, None, w, 0.0)
    assert not ticket.open and level(t) == pytest.approx(60000 - 150)
    t.charge(ticket, 200, (100, 0), 10**6, None, 0.0)  # once only
    assert level(t) == pytest.approx(60000 - 150)


def test_a_cut_stream_that_showed_the_engines_count_is_charged_it_exactly():
    t, _ = tenancy(tokens_per_min=60000)
    # SGLang's /generate reports its count in every event
    ticket = t.admit("acme", "", "m", {}, 100, {"sampling_params": {"max_new_tokens": 2000}}, 0.0, GENERATE)
    w = StreamWatch()
    for n in range(1, 31):
        w.feed(
            ev(
                {
                    "text": "x" * n,
                    "meta_info": {"prompt_tokens": 90, "cached_tokens": 0, "completion_tokens": n},
                }
            )
        )
    t.charge(ticket, None, None, None, w, 0.0)
    assert level(t) == pytest.approx(60000 - 120)  # the engine's prompt count + 30
    # an OpenAI stream that got as far as its usage event before the client left
    ticket = t.admit("acme", "", "m", {}, 100, {"max_completion_tokens": 2000}, 0.0, CHAT)
    w = StreamWatch(strip_usage=True)
    w.feed(ROLE + TOKEN * 5 + usage(100, 5))
    t.charge(ticket, None, None, None, w, 0.0)
    assert level(t) == pytest.approx(60000 - 120 - 105)


def test_an_answer_with_usage_is_charged_it_and_one_without_keeps_its_reservation():
    t, _ = tenancy(tokens_per_min=60000)
    a = t.admit("acme", "", "m", {}, 100, {"max_tokens": 500}, 0.0, COMPLETIONS)
    t.charge(a, 200, (90, 0), 20, None, 0.0)
    assert level(t) == pytest.approx(60000 - 110)
    # a completion count without the cached-token details (vLLM's default usage)
    b = t.admit("acme", "", "m", {}, 100, {}, 0.0, COMPLETIONS)
    t.charge(b, 200, None, 16, None, 0.0)
    assert level(t) == pytest.approx(60000 - 110 - 116)
    c = t.admit("acme", "", "m", {}, 100, {"max_tokens": 500}, 0.0, COMPLETIONS)
    t.charge(c, 200, None, None, None, 0.0)  # no usage: the reservation stands
    assert c.open and level(t) == pytest.approx(60000 - 110 - 116 - 600)
    # a complete stream without the engine's count: its events, or its reservation
    d = t.admit("acme", "", "m", {}, 10, {}, 0.0, CHAT)
    w = StreamWatch()
    w.feed(ROLE + TOKEN * 20 + b"data: [DONE]\n\n")
    t.charge(d, 200, None, None, w, 0.0)
    assert level(t) == pytest.approx(60000 - 110 - 116 - 600 - 31)  # 20 tokens, [DONE] counted


def test_a_worker_4xx_gives_the_tokens_back_and_keeps_the_request():
    """A request the worker refused (400 context_length_exceeded): nothing was
    generated, so nothing stays charged but the request itself."""
    t, _ = tenancy(tokens_per_min=60000, requests_per_s=10, request_burst=10)
    ticket = t.admit("acme", "", "m", {}, 50000, {"max_tokens": 100}, 0.0, COMPLETIONS)
    t.admitted(ticket, 0.0)
    assert level(t) == pytest.approx(60000 - 50100)
    t.charge(ticket, None, None, None, None, 0.0)  # a retried attempt: tells nothing
    assert ticket.open
    t.charge(ticket, 400, None, None, None, 0.0)
    assert not ticket.open and level(t) == 60000
    assert t._tenants["acme"][1].requests.level == 9  # the request still counts
    assert t.fair._served["acme"][0] == 0  # nor in its fair share
    t.fair.check()
    other = t.admit("acme", "", "m", {}, 50000, {}, 0.0, COMPLETIONS)  # the tenant's next
    assert other.reserved == 50000
    t.refused(other, 0.0)  # no worker ran it (every attempt a 429 or no connection)
    t.refused(other, 0.0)  # once only
    assert level(t) == 60000
    for status in (500, 502, 504):  # the worker's failure: the reservation stands
        x = t.admit("acme", "", "m", {}, 10, {}, 0.0, COMPLETIONS)
        t.charge(x, status, None, None, None, 0.0)
        assert x.open
    assert drained(t) == (5, 30.0)


def drained(t: Tenancy) -> tuple[int, float]:
    """(requests, tokens) acme's limit took net since the last drain (what a bus
    replica reports)."""
    out = {name: (r, tok) for kind, name, r, tok in t.drain() if kind == "tenant"}
    return out.get("acme", (0, 0.0))


# -- debts are bounded ------------------------------------------------------------------


def test_a_request_above_the_burst_is_refused_with_400_and_nothing_taken():
    """An 8 MB body (2,097,152 prompt tokens) against a burst of 6,000: refused at the
    door, so the tenant's other requests are not in its debt."""
    t, m = tenancy(tokens_per_min=60000, token_burst=6000)
    with pytest.raises(OverBurst) as ei:
        t.admit("acme", "", "m", {}, 2 * 2**20, {}, 0.0, COMPLETIONS)
    exc = ei.value
    assert (exc.status, exc.code, exc.param, exc.retry_after_s) == (400, "request_too_large", None, None)
    assert "counts 2097152 tokens" in exc.message and "token burst of 6000" in exc.message
    assert dict(exc.headers)["x-ratelimit-remaining-tokens"] == "6000"
    with pytest.raises(OverBurst) as ei:
        t.admit("acme", "", "m", {}, 100, {"max_completion_tokens": 5901}, 0.0, CHAT)
    assert ei.value.param == "max_completion_tokens" and "its prompt 100 + max_completion_tokens 5901" in (
        ei.value.message
    )
    assert level(t) == 6000
    t.admit("acme", "", "m", {}, 100, {"max_completion_tokens": 5900}, 0.0, CHAT)  # the burst: passes
    labels = {"tenant": "acme", "priority": "standard", "outcome": "limited"}
    assert m.registry.get_sample_value("radixfleet_tenant_requests_total", labels) == 2


def test_a_key_burst_refuses_too_and_takes_nothing_from_the_tenant():
    keys = {
        "tenant": {
            "source": "api_key",
            "api_keys": [{"tenant": "acme", "key": "k-batch", "name": "batch"}],
        }
    }
    cfg = parse_config(
        {
            "keys": keys,
            "tenancy": {
                "tenants": {"acme": {"tokens_per_min": 60000}},
                "keys": {"batch": {"tokens_per_min": 600}},
            },
        }
    )
    t = Tenancy(cfg.tenancy, [], Metrics(), 0.0)
    with pytest.raises(OverBurst, match="API key batch's token burst of 600"):
        t.admit("acme", "batch", "m", {}, 10, {"max_tokens": 600}, 0.0, COMPLETIONS)
    assert level(t) == 60000


def test_a_charge_after_admission_leaves_one_burst_of_debt_at_most():
    """An unbounded request that generated 10**6 tokens, then a peer's report of as
    many: the tenant waits two bursts' refill at most, not half an hour."""
    t, _ = tenancy(tokens_per_min=60000)
    ticket = t.admit("acme", "", "m", {}, 100, {}, 0.0, CHAT)
    t.admitted(ticket, 0.0)
    t.charge(ticket, 200, (100, 0), 10**6, None, 0.0)
    assert level(t) == -60000
    assert t.debit("tenant", "acme", 0, 10**6, 0.0)
    assert level(t) == -60000
    with pytest.raises(RateLimited) as ei:
        t.admit("acme", "", "m", {}, 100, {"max_tokens": 100}, 0.0, CHAT)
    assert ei.value.retry_after_s == pytest.approx(60.2)
    t.admit("acme", "", "m", {}, 100, {"max_tokens": 100}, 60.2, CHAT)
    t._tenants["acme"][1].tokens.check()
