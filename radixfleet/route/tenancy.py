"""Many tenants on one fleet: priority classes and rate limits per tenant and per API
key (YAML ``tenancy``), with per-tenant counts of what each got.

From a data-plane request's head, before its body is read (``DataPlane.screen_head``),
``tenancy.over_limit(tenant, key name, now)``: a tenant or key whose bucket cannot
give one request and one token now is refused at once (429, as below), its body
never read or parsed. Then, once it is keyed (its prompt tokens known) and before
the shedding decision (``DataPlane._route_and_forward``)::

    ticket = tenancy.admit(tenant, key name, model, headers, prompt tokens, body, now,
                           endpoint)
               class:  the priority header's claim, if within the key's (or else the
                       tenant's) max_priority; else the key's class, else the
                       tenant's, else the model's, else default_priority
               limits: the tenant's and the key's buckets (radixfleet.route.rate_limit): one
                       request and prompt + output bound tokens (output_bound), taken
                       from all or none -> else 429 RateLimited (Retry-After,
                       x-ratelimit-*); a cost above a token burst -> 400 OverBurst
    shedder.check(..., scale=ticket.scale)   the class scales the queue bound (a tenant
                                             under its fair share: the next class's,
                                             radixfleet.route.fair_share)
    (at saturation, with tenancy.queue.max_wait_s > 0, the request waits in the
    fair-share admission queue first: radixfleet.route.admission_queue)
    shed     -> tenancy.shed(ticket): the reservation given back, counted
    client gone while queued -> tenancy.refund(ticket)
    admitted -> tenancy.admitted(ticket, now); at the end of every attempt
                tenancy.charge(ticket, status, usage, output, watch, now): the token
                buckets (and the fair share) corrected to what the engine did, the
                first attempt that tells (below); no worker ran it -> tenancy.refused

The classes are the Gateway API Inference Extension's criticality: ``critical``,
``standard``, ``sheddable``. Each scales the shedder's queue bound
(``queue_scale``, critical >= standard >= sheddable, all > 0). The shedding decision
is monotone in its bound (a worker with room or with its queue within a bound is
within every larger one), so at any instant a request of a higher class is admitted
whenever one of a lower class would be: a critical request is never shed while
sheddable work is admitted, and under saturation the queue settles near the
sheddable bound, where sheddable requests absorb the shedding first. A request of a
tenant under its fair share of what was admitted lately (``radixfleet.route.fair_share``) has
the next higher class's factor (critical has none above it): it is shed no sooner than
a request of that class, never later, so a higher class is still admitted whenever it
is. Its admission-queue band and engine ``priority`` stay its class's (the queue
already orders a band by fair share). The whole next factor, not a share of the way to
it: half-way still shed the light tenant often (bench/RESULTS.md "Tenants and priority
classes").

Limits are kept per router process and, on a bus, shared: every ``bus.limits_interval_s``
each replica publishes what it took from each bucket since its last message, net
of refunds and corrections (``drain``), and every other replica charges its own
copy of that bucket with it (``debit``; radixfleet.wire.bus_wire ``limits``). Each
replica's buckets then hold the fleet's consumption, late by at most one interval
and the bus's latency: N replicas admit about one limit, not N, plus what the
replicas admit before they hear of each other (at most an interval's worth of the
limit's rate per replica). Without a bus (or with ``bus.share_limits`` off) each
process has its own limits: N replicas admit up to N times a limit.

Charged on what the engine does. A request's token cost is its prompt, counted in
the router's key space, plus its *output bound* (``output_bound``): the field the
engines obey for that endpoint, as they read it::

    /v1/chat/completions   max_completion_tokens if it is a positive count, else
                           max_tokens: vLLM and SGLang read ``max_completion_tokens or
                           max_tokens``, the agent the newer field whenever it is set
    /v1/completions        max_tokens (that API has no other; vLLM, SGLang and the
                           agent ignore a max_completion_tokens there)
    /generate              sampling_params.max_new_tokens (SGLang's native API)

A count is what the engines' request models take for one: an integer, an integral
float, a string of digits (a fraction rounds up; more than 30 digits counts 10**30).
No bound at all counts 0: the prompt alone is reserved, and what the engine generates
by its own default (vLLM: 16 for completions, the model's room for chat) is charged
from its usage or the events relayed (below). A bound beyond the model's room is no
bound the router needs to cap: vLLM and SGLang answer it 400 (``'max_tokens' or
'max_completion_tokens' is too large``), the agent 400 above its KV pool, and a
worker's 4xx gives the tokens back.

That cost is reserved at admission (the tenant's fair share counts it too:
``radixfleet.route.fair_share``) and corrected once, by the first attempt whose end tells
(``charge``)::

    the engine's count seen (usage or meta_info:   charged its prompt (the usage's, else
      completion_tokens; on a stream, also one       the router's count) + completion
      cut off before its end)                        tokens: the unused bound comes back
    a worker's 4xx answer (it refused the request  refused: the tokens come back, the
      before any work); or no worker ran it          request still counts
      (every attempt a 429/503 or no connection)
    a stream without the engine's count (the       at least the reservation: the
      client hung up, the worker broke off, or       router's prompt count + one token
      an engine that sends no usage)                 per event relayed from the first
                                                     output on, when that is more
    otherwise (no answer; a non-streamed answer    the reservation stands
      without usage)

Why a cut stream keeps at least its reservation: an engine sends several tokens in
one event when its client reads slower than it decodes (vLLM merges the outputs a
reader has not taken, the agent writes what became visible since its last write), so
the events relayed count fewer tokens than were generated; the reservation bounds
them from above. An unbounded request's reservation is its prompt only, so there the
events are the charge.

Debts are bounded. A request costing more than a limit's token burst is refused
with 400 ``request_too_large`` (``OverBurst``, nothing taken): no wait would let it
pass, and admitting it with a full bucket would leave the tenant in debt for as long
as it is larger (every other key of the tenant refused meanwhile). Charges after
admission (usage above the reservation, a peer replica's consumption) may take a
bucket below zero, never below minus one burst (``radixfleet.route.rate_limit``). So over any
T seconds the requests a tenant is admitted cost at most ``token_burst`` + T x
``tokens_per_min`` / 60, whatever fields they send or however they hang up; what
they generate beyond it is the output of requests that name no bound, charged when
each ends (as debt, one burst at most) and so delaying the tenant's next ones
(tests/chaos/test_tenancy.py).

Metric labels stay bounded: the tenants named in the YAML and the first others seen,
``top_n`` in all, keep their own ``tenant`` label; every other is counted as
``other`` (``TenantLabels``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from radixfleet.keys import Endpoint
from radixfleet.route.admission_queue import AdmissionQueueConfig
from radixfleet.route.fair_share import FairShare
from radixfleet.route.rate_limit import TokenBucket, duration
from radixfleet.wire.errors import ConfigError, MalformedRequest, OverBurst, RateLimited
from radixfleet.wire.settings import document_check, section, setting, settings

if TYPE_CHECKING:
    from radixfleet.server.sse import StreamWatch

#: the priority classes, highest first (their rank: the index)
PRIORITIES = ("critical", "standard", "sheddable")
Priority = Literal["critical", "standard", "sheddable"]
#: a class, or "" for "not set here"
MaybePriority = Literal["", "critical", "standard", "sheddable"]
_RANK = {p: i for i, p in enumerate(PRIORITIES)}
#: the metric label of tenants past the top_n
OTHER = "other"
_HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")


# ---------------------------------------------------------------------- the schema


@settings
class QueueScale:
    critical: float = setting(
        4.0, "critical requests: factor on the shedder's queue bound", lo=0, lo_open=True, hi=1000
    )
    standard: float = setting(1.0, "standard requests: factor on the bound", lo=0, lo_open=True, hi=1000)
    sheddable: float = setting(0.25, "sheddable requests: factor on the bound", lo=0, lo_open=True, hi=1000)

    @document_check
    def _check(self) -> None:
        if not self.critical >= self.standard >= self.sheddable:
            raise ConfigError(
                "",
                "expected critical >= standard >= sheddable (a higher class is shed no "
                f"sooner than a lower one), got {self.critical:g}, {self.standard:g}, {self.sheddable:g}",
            )


@settings
class FairShareConfig:
    under: float = setting(
        0.8,
        "a tenant whose recent admitted tokens are under this share of its weighted fair share "
        "(tenancy.queue.weights) is shed as the next class up is (that class's queue_scale; its "
        "queue band and engine priority stay its own); 0: off",
        lo=0,
        hi=1,
    )
    half_life_s: float = setting(
        10.0, "seconds over which a tenant's admitted tokens count half as much", lo=0, lo_open=True, hi=3600
    )


@settings
class TenantRules:
    """The class and the limits of one tenant (``tenancy.tenants.<tenant>``) or one
    API key (``tenancy.keys.<name>``, the ``name`` of a ``keys.tenant.api_keys`` entry)."""

    priority: MaybePriority = setting("", "class of its requests; empty: not set here")
    max_priority: MaybePriority = setting(
        "", "the highest class its requests may claim with the priority header; empty: its own class"
    )
    requests_per_s: float = setting(0.0, "request rate limit (0: none)", lo=0)
    request_burst: int = setting(0, "requests allowed at once (0: the rate's, at least 1)", lo=0)
    tokens_per_min: float = setting(
        0.0,
        "token rate limit: prompt + the output bound the engine obeys (max_completion_tokens, "
        "max_tokens, sampling_params.max_new_tokens) reserved, corrected to what the engine did (0: none)",
        lo=0,
    )
    token_burst: int = setting(
        0, "tokens allowed at once (0: a minute's worth); a request costing more is refused (400)", lo=0
    )

    @document_check
    def _check(self) -> None:
        if self.request_burst and not self.requests_per_s:
            raise ConfigError("request_burst", "needs requests_per_s > 0")
        if self.token_burst and not self.tokens_per_min:
            raise ConfigError("token_burst", "needs tokens_per_min > 0")
        if self.priority and self.max_priority and _RANK[self.max_priority] > _RANK[self.priority]:
            raise ConfigError(
                "max_priority", f"{self.max_priority!r} is below its own class {self.priority!r}"
            )


@settings
class TenancyConfig:
    default_priority: Priority = setting("standard", "class of requests nothing else classes")
    priority_header: str = setting(
        "x-radixfleet-priority",
        "request header naming a class (critical, standard, sheddable): any class at or "
        "below the key's or tenant's max_priority; a higher claim gets the request's own "
        "class (counted); empty: the header is ignored",
    )
    queue_scale: QueueScale = section(QueueScale, "per class, the factor on the shedder's queue bound")
    queue: AdmissionQueueConfig = section(
        AdmissionQueueConfig,
        "at saturation, the fair-share admission queue (radixfleet.route.admission_queue): by class, "
        "then weighted fair queuing across tenants on tokens",
    )
    fair_share: FairShareConfig = section(
        FairShareConfig,
        "a tenant under its fair share of what the fleet admits lately is shed as the next "
        "class up is (radixfleet.route.fair_share)",
    )
    models: Mapping[str, Priority] = Field(
        default_factory=dict, description="served model name -> class of its requests"
    )
    tenants: Mapping[str, TenantRules] = Field(
        default_factory=dict, description="tenant -> its class and rate limits"
    )
    keys: Mapping[str, TenantRules] = Field(
        default_factory=dict,
        description="API key name (keys.tenant.api_keys[].name) -> its class and rate limits",
    )
    top_n: int = setting(
        20, "tenants with their own metric label; the others are counted as 'other'", lo=0, hi=1000
    )

    @document_check
    def _check(self) -> None:
        if self.priority_header and not _HEADER_NAME.fullmatch(self.priority_header):
            raise ConfigError(
                "priority_header", f"expected a lower-case HTTP header name, got {self.priority_header!r}"
            )


def check_key_names(tenancy: TenancyConfig, tenant: Any) -> None:
    """``tenancy.keys`` names only named API keys, and key names are unique (paths
    from the document's root). ``tenant``: the ``keys.tenant`` section."""
    named: dict[str, int] = {}
    for i, spec in enumerate(tenant.api_keys):
        if spec.name in named:
            raise ConfigError(
                f"keys.tenant.api_keys[{i}].name", f"{spec.name!r} is already the name of another key"
            )
        if spec.name:
            named[spec.name] = i
    for name in tenancy.keys:
        if tenant.source != "api_key":
            raise ConfigError(f"tenancy.keys.{name}", "per-key rules need keys.tenant.source: api_key")
        if name not in named:
            known = ", ".join(sorted(named)) or "(none: give api_keys entries a name)"
            raise ConfigError(f"tenancy.keys.{name}", f"no API key has this name; named: {known}")


# ---------------------------------------------------------------------- at run time


class _Limit:
    """One tenant's or key's buckets (either may be None: no limit of that kind)."""

    __slots__ = ("what", "requests", "tokens", "spent_requests", "spent_tokens")

    def __init__(self, what: str) -> None:
        self.what = what  # "tenant acme" | "API key batch" (never the key itself)
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        #: what this process took since the last ``Tenancy.drain`` (net of gives)
        self.spent_requests = 0
        self.spent_tokens = 0.0

    def set(self, rules: TenantRules, now: float) -> None:
        """Takes ``rules`` (a reload keeps what was used so far)."""
        self.requests = _bucket(
            self.requests, rules.requests_per_s, rules.request_burst or max(1.0, rules.requests_per_s), now
        )
        per_s = rules.tokens_per_min / 60.0
        self.tokens = _bucket(self.tokens, per_s, rules.token_burst or rules.tokens_per_min, now)

    def wait_s(self, cost: int, now: float) -> float:
        r = self.requests.wait_s(1, now) if self.requests is not None else 0.0
        t = self.tokens.wait_s(cost, now) if self.tokens is not None else 0.0
        return r if r > t else t

    def take(self, cost: int) -> None:
        if self.requests is not None:
            self.requests.take(1)
            self.spent_requests += 1
        if self.tokens is not None:
            self.tokens.take(cost)
            self.spent_tokens += cost

    def give(self, requests: int, tokens: float, now: float) -> None:
        if self.requests is not None and requests:
            self.requests.give(requests, now)
            self.spent_requests -= requests
        if self.tokens is not None and tokens:
            self.tokens.give(tokens, now)
            self.spent_tokens -= tokens

    def debit(self, requests: float, tokens: float, now: float) -> None:
        """Another replica took ``requests`` and ``tokens`` (negative: gave back) from
        its copy of these buckets: charged here too (debt allowed), not counted as
        this process's spending."""
        if self.requests is not None and requests:
            self.requests.give(-requests, now)
        if self.tokens is not None and tokens:
            self.tokens.give(-tokens, now)

    def headers(self) -> tuple[tuple[str, str], ...]:
        """The ``x-ratelimit-*`` headers, as OpenAI names them."""
        out: list[tuple[str, str]] = []
        for kind, b in (("requests", self.requests), ("tokens", self.tokens)):
            if b is not None:
                out += _bucket_headers(kind, b)
        return tuple(out)

    def over_burst(self, cost: int, bound: int, field: str) -> OverBurst | None:
        """The refusal of a request costing ``cost`` tokens (``bound`` of them its
        ``field``'s output bound) when that is more than the token burst; else None."""
        b = self.tokens
        if b is None or cost <= b.burst:
            return None
        said = f"its prompt {cost - bound} + {field} {bound}" if field else f"its prompt {cost}"
        fix = f"a lower {field}" if field else "a shorter prompt"
        return OverBurst(
            f"this request counts {cost} tokens ({said}), more than {self.what}'s token burst "
            f"of {b.burst:g}: it can never pass its limit; send {fix}",
            param=field or None,
            headers=self.headers(),
        )

    def refusal(self, cost: int, wait_s: float, *, at_least: bool = False) -> RateLimited:
        """The 429 of a request costing ``cost`` tokens (``at_least``: at least that
        many, its body not read yet) that could pass in ``wait_s``."""
        parts = []
        if self.requests is not None:
            parts.append(f"{self.requests.rate:g} requests/s (burst {self.requests.burst:g})")
        if self.tokens is not None:
            parts.append(f"{self.tokens.rate * 60:g} tokens/min (burst {self.tokens.burst:g})")
        return RateLimited(
            f"{self.what} is over its rate limit of {' and '.join(parts)}; this request "
            f"counts 1 request and {'at least ' if at_least else ''}{cost} "
            f"token{'' if cost == 1 else 's'}; retry in {wait_s:.2f}s",
            retry_after_s=wait_s,
            headers=self.headers(),
        )


def _bucket_headers(kind: str, b: TokenBucket) -> list[tuple[str, str]]:
    return [
        (f"x-ratelimit-limit-{kind}", str(int(b.burst))),
        (f"x-ratelimit-remaining-{kind}", str(b.remaining())),
        (f"x-ratelimit-reset-{kind}", duration(b.reset_s())),
    ]


def _bucket(old: TokenBucket | None, rate: float, burst: float, now: float) -> TokenBucket | None:
    if rate <= 0:
        return None
    if old is None:
        return TokenBucket(rate, burst, now)
    old.reconfigure(rate, burst, now)
    return old


class TenantLabels:
    """Bounded metric labels: the tenants named first, then the first others seen,
    ``top_n`` in all, keep their name; every other tenant is ``other``.

    Invariants (``check()``): at most ``max(top_n, named)`` own labels; a tenant's
    label never changes (a Prometheus series is never split)."""

    __slots__ = ("top_n", "_own")

    def __init__(self, top_n: int) -> None:
        self.top_n = top_n
        self._own: dict[str, str] = {}  # tenant -> its label (only label() adds)

    def name(self, tenants: Iterable[str]) -> None:
        """Gives ``tenants`` (the YAML's, in order) their labels while there is room."""
        for t in tenants:
            self.label(t)

    def label(self, tenant: str) -> str:
        lab = self._own.get(tenant)
        if lab is not None:
            return lab
        if len(self._own) >= self.top_n:
            return OTHER
        lab = self._own[tenant] = tenant or "-"
        return lab

    def check(self) -> None:
        assert all(v == (k or "-") for k, v in self._own.items()), self._own


#: a tenant's or key's rules and its buckets (None: no limit)
_Rules = tuple[TenantRules, _Limit | None]


class Ticket:
    """One admitted request's class and reservation (``Tenancy.admit``)."""

    __slots__ = ("tenant", "label", "priority", "scale", "prompt", "reserved", "limits", "open")

    def __init__(
        self,
        tenant: str,
        label: str,
        priority: str,
        scale: float,
        prompt: int,
        reserved: int,
        limits: tuple[_Limit, ...],
    ) -> None:
        self.tenant = tenant
        self.label = label  # the tenant's metric label
        self.priority = priority  # its class (what it is counted under)
        #: the factor on the shedder's bound: its class's, or the next higher class's for a
        #: tenant under its fair share (module docstring)
        self.scale = scale
        self.prompt = prompt  # its prompt tokens as the router counts them
        #: tokens taken from the token buckets: prompt + the output bound (output_bound)
        self.reserved = reserved
        self.limits = limits  # the _Limit objects it was taken from
        self.open = True  # until shed or settled (a reservation is corrected once)

    @property
    def rank(self) -> int:
        """Its class's PRIORITIES index: the admission queue's band, the engine's ``priority``."""
        return _RANK[self.priority]

    def headers(self) -> tuple[tuple[str, str], ...]:
        """The ``x-ratelimit-*`` headers an admitted answer carries, as OpenAI sends
        them on every answer: per kind (requests, tokens), the bucket of the limits it
        passed with the least remaining (a tenant's and a key's limit may both apply);
        none without limits."""
        out: list[tuple[str, str]] = []
        if self.limits:
            for kind in ("requests", "tokens"):
                buckets = [b for b in (getattr(lim, kind) for lim in self.limits) if b is not None]
                if buckets:
                    out += _bucket_headers(kind, min(buckets, key=TokenBucket.remaining))
        return tuple(out)


class Tenancy:
    """Classes and limits per tenant and key. One event loop owns it; ``admit`` is
    O(1) (two dict lookups, at most two limits of two buckets, the fair share's
    lookup; its refresh, O(tenants seen lately), at most every 0.5 s). ``configure``
    follows a reload: buckets of names still configured keep their levels.

    ``metrics``: a ``radixfleet.server.metrics.Metrics`` (its ``tenant_requests`` and
    ``priority_refused`` counters)."""

    def __init__(self, cfg: TenancyConfig, named_tenants: Iterable[str], metrics: Any, now: float) -> None:
        self.metrics = metrics
        self.labels = TenantLabels(cfg.top_n)
        self._tenants: dict[str, _Rules] = {}
        self._keys: dict[str, _Rules] = {}
        self._counters: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        fs = cfg.fair_share
        self.fair = FairShare(fs.half_life_s, fs.under, cfg.queue.weights)
        self.configure(cfg, named_tenants, now)

    def configure(self, cfg: TenancyConfig, named_tenants: Iterable[str], now: float) -> None:
        """Takes ``cfg``; ``named_tenants``: the tenants the YAML names elsewhere (API
        keys', the default), labelled first after ``tenancy.tenants``."""
        self.cfg = cfg
        self.header = cfg.priority_header
        qs = cfg.queue_scale
        self._scale = {"critical": qs.critical, "standard": qs.standard, "sheddable": qs.sheddable}
        self.fair.configure(cfg.fair_share.half_life_s, cfg.fair_share.under, cfg.queue.weights)
        self.labels.top_n = max(self.labels.top_n, cfg.top_n)
        self.labels.name(cfg.tenants)
        self.labels.name(named_tenants)
        self._tenants = {
            t: (r, _limit(self._tenants.get(t), f"tenant {t}", r, now)) for t, r in cfg.tenants.items()
        }
        self._keys = {k: (r, _limit(self._keys.get(k), f"API key {k}", r, now)) for k, r in cfg.keys.items()}

    def admit(
        self,
        tenant: str,
        key: str,
        model: str,
        headers: Mapping[str, str],
        prompt_tokens: int,
        body: Mapping[str, Any],
        now: float,
        endpoint: Endpoint = Endpoint.CHAT,
    ) -> Ticket:
        """The request's class and its reservation under its tenant's and key's limits:
        ``prompt_tokens`` + the output bound ``body`` gives on ``endpoint``
        (``output_bound``; a prefetch's body is read as chat's). Raises
        ``RateLimited`` or ``OverBurst`` (nothing taken) or ``MalformedRequest`` (a
        priority header naming no class)."""
        t = self._tenants.get(tenant)
        k = self._keys.get(key) if key else None
        label = self.labels.label(tenant)
        priority = self._priority(t, k, model, headers, label)
        bound, field = output_bound(endpoint, body)
        cost = prompt_tokens + bound
        limits = tuple(x[1] for x in (t, k) if x is not None and x[1] is not None)
        for lim in limits:
            too_large = lim.over_burst(cost, bound, field)
            if too_large is not None:
                self._count(label, priority)[2].inc()
                raise too_large
        for lim in limits:
            wait = lim.wait_s(cost, now)
            if wait > 0.0:
                self._count(label, priority)[2].inc()
                raise lim.refusal(cost, wait)
        for lim in limits:
            lim.take(cost)
        rank = _RANK[priority]
        scale = self._scale[priority]
        if rank and self.fair.is_under(tenant, now):
            scale = self._scale[PRIORITIES[rank - 1]]
            self.metrics.tenant_promoted.labels(label).inc()
        return Ticket(tenant, label, priority, scale, prompt_tokens, cost, limits)

    def over_limit(self, tenant: str, key: str, now: float) -> RateLimited | None:
        """The refusal a request of ``tenant`` with API key ``key`` gets whatever its
        body, or None: its tenant's or key's request bucket cannot give one request
        now, or its token bucket not the least a request costs (one token). Checked
        from the head, before the body is read (``DataPlane.screen_head``); takes nothing
        (``admit`` takes). O(1)."""
        t = self._tenants.get(tenant)
        k = self._keys.get(key) if key else None
        for rules in (t, k):
            lim = rules[1] if rules is not None else None
            if lim is None:
                continue
            wait = lim.wait_s(1, now)
            if wait > 0.0:
                label = self.labels.label(tenant)
                base = (k[0].priority if k is not None else "") or (t[0].priority if t is not None else "")
                self._count(label, base or self.cfg.default_priority)[2].inc()
                return lim.refusal(1, wait, at_least=True)
        return None

    def drain(self) -> list[tuple[str, str, int, float]]:
        """What this process took from each limit since the last call, net of
        refunds and corrections, as (``tenant`` | ``key``, name, requests, tokens):
        the limits that changed. O(limits configured)."""
        out = []
        for kind, rules in (("tenant", self._tenants), ("key", self._keys)):
            for name, (_, lim) in rules.items():
                if lim is not None and (lim.spent_requests or lim.spent_tokens):
                    out.append((kind, name, lim.spent_requests, lim.spent_tokens))
                    lim.spent_requests, lim.spent_tokens = 0, 0.0
        return out

    def debit(self, kind: str, name: str, requests: float, tokens: float, now: float) -> bool:
        """Another replica's consumption of limit ``name`` (``drain``'s entry):
        charged to this process's copy. False when no such limit is configured
        here (a peer with another config: ignored)."""
        r = (self._tenants if kind == "tenant" else self._keys).get(name)
        if r is None or r[1] is None:
            return False
        r[1].debit(requests, tokens, now)
        return True

    def admitted(self, ticket: Ticket, now: float) -> None:
        """The request goes to a worker: counted, and its tokens to its tenant's share."""
        self._count(ticket.label, ticket.priority)[0].inc()
        self.fair.served(ticket.tenant, ticket.reserved, now)

    def shed(self, ticket: Ticket, now: float) -> None:
        """The request was shed: what it reserved is given back."""
        self._count(ticket.label, ticket.priority)[1].inc()
        self.refund(ticket, now)

    def refund(self, ticket: Ticket, now: float) -> None:
        """The request never reached a worker (shed, or its client left while it
        waited in the admission queue): what it reserved is given back, once."""
        if ticket.open:
            ticket.open = False
            for lim in ticket.limits:
                lim.give(1, ticket.reserved, now)

    def settle(self, ticket: Ticket, used_tokens: int, now: float) -> None:
        """The answer's usage: the token reservation corrected to ``used_tokens``
        (once per request)."""
        if ticket.open:
            ticket.open = False
            for lim in ticket.limits:
                lim.give(0, ticket.reserved - used_tokens, now)
            self.fair.served(ticket.tenant, used_tokens - ticket.reserved, now)

    def refused(self, ticket: Ticket, now: float) -> None:
        """No worker ran the admitted request (a worker answered it 4xx, refusing it
        before any work, or every attempt provably did not run it): its tokens given
        back to its limits and taken out of its tenant's fair share, once. Its request
        still counts: it reached a worker."""
        if ticket.open:
            ticket.open = False
            for lim in ticket.limits:
                lim.give(0, ticket.reserved, now)
            self.fair.served(ticket.tenant, -ticket.reserved, now)

    def charge(
        self,
        ticket: Ticket,
        status: int | None,
        usage: tuple[int, int] | None,
        output: int | None,
        watch: StreamWatch | None,
        now: float,
    ) -> None:
        """What the end of one attempt tells the token limits (module docstring,
        "Charged on what the engine does"); the first attempt that tells closes the
        ticket, one that tells nothing (a retried failure) leaves it open. ``status``:
        the answer the client got from this attempt (None: none, or it left before the
        end); ``usage``, ``output``: (prompt, cached) and completion tokens its answer
        reported; ``watch``: the stream's, when one was relayed (its own count seen,
        its output events). O(limits)."""
        if not ticket.open:
            return
        if watch is not None:
            if output is None:
                output = watch.output_tokens
            if usage is None:
                usage = watch.usage
        if output is not None:
            self.settle(ticket, (usage[0] if usage is not None else ticket.prompt) + output, now)
        elif status is not None and 400 <= status < 500:
            self.refused(ticket, now)
        elif watch is not None:
            used = ticket.prompt + watch.output_events
            if used > ticket.reserved:
                self.settle(ticket, used, now)

    def _priority(
        self, t: _Rules | None, k: _Rules | None, model: str, headers: Mapping[str, str], label: str
    ) -> str:
        base = (
            (k[0].priority if k is not None else "")
            or (t[0].priority if t is not None else "")
            or self.cfg.models.get(model, "")
            or self.cfg.default_priority
        )
        raw = headers.get(self.header) if self.header else None
        if not raw:
            return base
        claim = str(raw).strip().lower()
        if claim not in _RANK:
            raise MalformedRequest(
                f"header {self.header}: {claim[:64]!r} is not one of {', '.join(PRIORITIES)}"
            )
        ceiling = (k[0].max_priority if k is not None else "") or (t[0].max_priority if t is not None else "")
        allowed = ceiling if ceiling and _RANK[ceiling] < _RANK[base] else base
        if _RANK[claim] < _RANK[allowed]:
            self.metrics.priority_refused.labels(label).inc()
            return base
        return claim

    def _count(self, label: str, priority: str) -> tuple[Any, Any, Any]:
        """The (admitted, shed, limited) counters of a label and class, cached."""
        c = self._counters.get((label, priority))
        if c is None:
            m = self.metrics.tenant_requests
            c = self._counters[(label, priority)] = tuple(
                m.labels(label, priority, outcome) for outcome in ("admitted", "shed", "limited")
            )
        return c


def _limit(old: _Rules | None, what: str, rules: TenantRules, now: float) -> _Limit | None:
    if not rules.requests_per_s and not rules.tokens_per_min:
        return None
    lim = old[1] if old is not None and old[1] is not None else _Limit(what)
    lim.set(rules, now)
    return lim


#: the field bounding the output, per endpoint, as the engines read it (module docstring)
_BOUND_FIELDS = {
    Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
}
_DIGITS = re.compile(r"\s*\+?(\d+)\s*", re.ASCII)
#: what a count of more than 30 digits is taken for (no engine's context holds it)
_HUGE = 10**30


def output_bound(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[int, str]:
    """The most tokens the engine generates for ``body`` on ``endpoint``, and the field
    that says so; (0, "") when none does (module docstring). O(1)."""
    if endpoint is Endpoint.GENERATE:
        sp = body.get("sampling_params")
        n = _count(sp.get("max_new_tokens")) if isinstance(sp, dict) else 0
        return (n, "sampling_params.max_new_tokens") if n else (0, "")
    for field in _BOUND_FIELDS[endpoint]:
        n = _count(body.get(field))
        if n:
            return n, field
    return 0, ""


def _count(v: Any) -> int:
    """A token count as the engines' request models read one (pydantic's lax int: an
    integer or bool, an integral float, a string of digits), 0 when it is none or not
    positive; a fraction rounds up (the engine refuses it: a 4xx, given back)."""
    if isinstance(v, int):  # bool included, as pydantic reads it
        return int(v) if v > 0 else 0
    if isinstance(v, float):
        return math.ceil(v) if math.isfinite(v) and v > 0 else 0
    if isinstance(v, str):
        m = _DIGITS.fullmatch(v)
        if m is None:
            return 0
        digits = m.group(1)
        return _HUGE if len(digits) > 30 else int(digits)
    return 0
