"""The router's Prometheus metrics, in a registry of its own (one per app, so two
routers in one process — tests — never share counters).

Request-path metrics are incremented inline through cached label children (a
dict lookup, not ``labels()``, per request). State metrics — in-flight per worker,
breaker state, health, index size, hot prefixes — are read from the pool and the
index when ``/metrics`` is scraped (``refresh``), costing the request path nothing.

    radixfleet_requests_total{worker,status,reason}   client requests a worker answered,
                                                      once each, by the status the
                                                      client got (retries not counted)
    radixfleet_upstream_attempts_total{worker,outcome}  every try on a worker: its
                                                      status, or connect | no_answer |
                                                      unhealthy | timeout | payload |
                                                      too_large
    radixfleet_rejected_total{status,code}            answered by the router itself (4xx/5xx)
    radixfleet_ttfb_seconds                           arrival -> the worker's response head
    radixfleet_ttft_seconds                           arrival -> the first content token's
                                                      event (radixfleet.server.sse), streams only
    radixfleet_prompt_tokens_total{worker,model}      prompt tokens of answered requests, as
                                                      the worker's usage reported them
    radixfleet_cached_tokens_total{worker,model}      of those, found in its prefix cache
                                                      (usage.prompt_tokens_details): delivered
    radixfleet_available_cached_tokens_total{worker,model}  of those, the best match among the
                                                      eligible workers at pick time: available
    radixfleet_predicted_cached_tokens_total{worker,model}  of those, the chosen worker's match
                                                      at pick time: predicted (radixfleet.route.decisions;
                                                      all three over the same answers)
    radixfleet_worker_requests_total{worker,model,outcome}  tries on a worker: answered, failed
                                                      (the worker), gone (the client left)
    radixfleet_worker_queued_requests{worker}, _running_requests{worker},
      radixfleet_worker_kv_used_ratio{worker}         the worker's own last fresh load
                                                      report (agent push or engine /metrics)
    radixfleet_worker_batch_limit{worker}             the engine's batch limit as learned
                                                      (radixfleet.route.shedding; absent until seen)
    radixfleet_request_seconds                        arrival -> last byte
    radixfleet_matched_prefix_tokens                  tokens of the chosen worker's match
    radixfleet_retries_total{cause}                   connect | status (429, 503) |
                                                      unhealthy | rank | a 5xx, payload or
                                                      no_answer from a worker gone down
    radixfleet_in_flight{worker}, radixfleet_worker_breaker_state{worker} (0 closed,
      1 half-open, 2 open), radixfleet_worker_healthy{worker}
    radixfleet_index_nodes, _index_holder_entries, _index_bytes (gauges),
      radixfleet_index_evicted_entries_total (counter)
    radixfleet_events_applied_total{type}, radixfleet_event_batches_total{status}
    radixfleet_registrations_refused_total{reason}    block_bytes_mismatch,
                                                      worker_id_taken, overloaded,
                                                      epoch_churn, worker_url_is_router,
                                                      worker_host_not_allowed,
                                                      agent_token_required
                                                      (radixfleet.fleet.registration)
    radixfleet_workers_reaped_total                   self-registered workers removed
                                                      after unhealthy_grace_s
    radixfleet_peer_hangups_total{path}               agent API peers that hung up
                                                      before their request was read
    radixfleet_hot_prefixes                           hot prefixes tracked (<= index.hot_k)
    radixfleet_hot_prefix_rate{rank}, radixfleet_hot_prefix_replicas{rank}  by rank 1..k
    radixfleet_warmups_total{status}
    radixfleet_pd_requests_total{path}                disaggregated models (radixfleet.route.pd): prefill
                                                      (two legs) | colocated
    radixfleet_pd_no_decode_total{when}               their 503s without a decode worker:
                                                      before | after_prefill
    radixfleet_pd_kv_handoffs_total{outcome}          prefill legs answered: params | none |
                                                      bootstrap (SGLang)
    radixfleet_pd_prefill_seconds                     a vLLM-protocol prefill leg, sent to its
                                                      answer (the KV hand-off)
    radixfleet_prefetch_total{outcome}                POST /v1/prefetch (radixfleet.server.prefetch):
                                                      warmed | deduplicated (already held,
                                                      nothing sent) | used (a real request
                                                      matched it on its worker) | evicted,
                                                      unused (wasted: not used within
                                                      prefetch.window_s) | failed (its
                                                      prefill request failed)
    radixfleet_prefetch_dropped_total{cause}          refused with 429, nothing warmed:
                                                      budget | load
    radixfleet_prefetch_tokens_total                  uncached prompt tokens prefetches
                                                      sent to workers (the extra prefill)
    radixfleet_shed_total                             429s from the fleet's queue bound
    radixfleet_tenant_requests_total{tenant,priority,outcome}  per tenant (tenancy.top_n
                                                      named, the rest 'other') and class:
                                                      admitted | shed | limited (radixfleet.route.tenancy)
    radixfleet_admission_queued{priority}             requests waiting in the fair-share
                                                      admission queue (radixfleet.route.admission_queue)
    radixfleet_admission_queue_wait_seconds{priority,outcome}  their waits: admitted |
                                                      expired (then 429) | left (client gone)
    radixfleet_priority_claims_refused_total{tenant}  priority headers claiming a class above
                                                      the key's or tenant's max_priority
    radixfleet_bad_http_total{status}                 malformed HTTP answered 4xx
    radixfleet_connections_refused_total{reason}      client connections at limits.max_connections:
                                                      idle_closed (longest-idle one closed to make
                                                      room) | at_capacity (the new one refused, 429)
    radixfleet_client_disconnects_total{phase}        clients that closed their connection while
                                                      their request was served (radixfleet.server.front):
                                                      waiting (no answer byte yet) | streaming
    radixfleet_slow_clients_dropped_total{reason}     clients dropped for not taking their
                                                      answer (radixfleet.server.front): idle (none of
                                                      it for timeouts.client_idle_s) |
                                                      deadline (timeouts.total_s passed)
    radixfleet_body_bytes_held                        request body bytes held (radixfleet.server.intake's
                                                      budget, limits.max_buffered_body_bytes)
    radixfleet_config_reloads_total                   configuration reloads applied
    radixfleet_config_reload_failures_total{reason}   reloads refused, the running config kept:
                                                      invalid | empty (the file holds no
                                                      settings) | downgrade (it lowers security
                                                      and the reload did not ask for it:
                                                      radixfleet.config.reload)
    radixfleet_autoscale_desired_workers              radixfleet.fleet.scaling_signal's signal (set at scrape)
    radixfleet_autoscale_workers{part}                its parts: compute, holders, kv, queue,
                                                      current
    radixfleet_traffic_log_records_total{outcome}     written, dropped_full, dropped_error,
                                                      sampled_out (read from the log at scrape)
    radixfleet_traffic_log_write_errors_total, radixfleet_traffic_log_queued
    radixfleet_tracing_spans_total{outcome}           with tracing on (radixfleet.server.tracing): exported |
                                                      dropped_queue_full (tracing.max_queue_spans
                                                      waiting) | dropped_export_failed (the
                                                      collector down, slow or refusing)
    radixfleet_tracing_queued_spans                   spans waiting for the export thread
    radixfleet_traffic_log_writing                    1 writing, 0 stopped by a write error
                                                      (radixfleet.server.traffic_log: retried, kept
                                                      files never rotated out meanwhile)
    process_*, python_gc_*, python_info               the standard process collectors

No series carries a prefix hash: a hash is a tenant's prompt fingerprint, and the
metrics page is served on the data-plane port (to the metrics or admin token, or to
loopback peers while no metrics token is set: radixfleet.server.auth.check_metrics). Per-prefix detail (hash,
depth,
holders) is at ``/admin/index``, behind the admin token. ``_created`` series are
not exported (``prometheus_client.disable_created_metrics``, process-wide).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixfleet.common.metrics import standard_collectors
from radixfleet.config.reload import FAILURE_REASONS
from radixfleet.fleet.pool import BREAKER_GAUGE, HealthState

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

#: matched-prefix histogram buckets, in tokens
_MATCH_BUCKETS = (0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """All router metrics. Only the app and the feedback handler increment them."""

    def __init__(self) -> None:
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        standard_collectors(r)
        self.requests = Counter(
            "radixfleet_requests",
            "Client requests a worker answered, by the status the client got and the decision reason",
            ["worker", "status", "reason"],
            registry=r,
        )
        self.attempts = Counter(
            "radixfleet_upstream_attempts",
            "Tries on a worker, by its status or the failure cause",
            ["worker", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "radixfleet_rejected", "Requests the router answered itself", ["status", "code"], registry=r
        )
        self.ttfb = Histogram(
            "radixfleet_ttfb_seconds", "Time to the worker's first byte", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "radixfleet_request_seconds", "Total request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "radixfleet_ttft_seconds",
            "Streamed requests: arrival at the router to the first content token sent on",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "radixfleet_prompt_tokens",
            "Prompt tokens of answered requests, as the worker's usage reported them",
            ["worker", "model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "radixfleet_cached_tokens",
            "Of those, tokens the worker "
            "found in its prefix cache (usage.prompt_tokens_details."
            "cached_tokens)",
            ["worker", "model"],
            registry=r,
        )
        self.available_tokens = Counter(
            "radixfleet_available_cached_tokens",
            "Of those, tokens the best-matching eligible worker held at pick time "
            "(the reuse available anywhere in the fleet: radixfleet.route.decisions)",
            ["worker", "model"],
            registry=r,
        )
        self.predicted_tokens = Counter(
            "radixfleet_predicted_cached_tokens",
            "Of those, tokens the chosen worker was predicted to hold at pick time "
            "(radixfleet.route.decisions)",
            ["worker", "model"],
            registry=r,
        )
        self.worker_requests = Counter(
            "radixfleet_worker_requests",
            "Tries on a worker by model and outcome: answered, failed (the worker), gone (the client left)",
            ["worker", "model", "outcome"],
            registry=r,
        )
        self.worker_queued = Gauge(
            "radixfleet_worker_queued_requests",
            "Requests waiting in the worker, from its last fresh load report",
            ["worker"],
            registry=r,
        )
        self.worker_running = Gauge(
            "radixfleet_worker_running_requests",
            "Requests running in the worker, from its last fresh load report",
            ["worker"],
            registry=r,
        )
        self.worker_kv = Gauge(
            "radixfleet_worker_kv_used_ratio",
            "KV cache in use, 0..1, from the worker's last fresh load report",
            ["worker"],
            registry=r,
        )
        self.worker_batch_limit = Gauge(
            "radixfleet_worker_batch_limit",
            "The engine's batch limit as learned from its reports (radixfleet.route.shedding)",
            ["worker"],
            registry=r,
        )
        self.matched = Histogram(
            "radixfleet_matched_prefix_tokens",
            "Tokens of the request the chosen worker was believed to hold",
            buckets=_MATCH_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            "radixfleet_shed",
            "Requests shed with 429 because every eligible worker's queue was past its bound",
            registry=r,
        )
        self.tenant_requests = Counter(
            "radixfleet_tenant_requests",
            "Data-plane requests by tenant (past tenancy.top_n: other), priority class and "
            "outcome: admitted, shed (fleet saturated) or limited (over a rate limit)",
            ["tenant", "priority", "outcome"],
            registry=r,
        )
        self.tenant_promoted = Counter(
            "radixfleet_tenant_promoted",
            "Requests shed as the next class up is (that class's bound) because their tenant "
            "was under its fair share of what the fleet admitted lately (radixfleet.route.fair_share)",
            ["tenant"],
            registry=r,
        )
        self.admission_queued = Gauge(
            "radixfleet_admission_queued",
            "Requests waiting in the fair-share admission queue at saturation, by priority class",
            ["priority"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "radixfleet_admission_queue_wait_seconds",
            "Seconds requests waited in the admission queue, by priority class and outcome: "
            "admitted, expired (answered 429) or left (the client went away)",
            ["priority", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.priority_refused = Counter(
            "radixfleet_priority_claims_refused",
            "Requests whose priority header claimed a class above their max_priority (served at their own)",
            ["tenant"],
            registry=r,
        )
        self.bad_http = Counter(
            "radixfleet_bad_http", "Malformed HTTP requests answered 4xx", ["status"], registry=r
        )
        self.connections_refused = Counter(
            "radixfleet_connections_refused",
            "Client connections closed or refused at the connection cap",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "radixfleet_client_disconnects",
            "Clients that closed their connection while their request was served",
            ["phase"],
            registry=r,
        )
        for phase in ("waiting", "streaming"):
            self.client_disconnects.labels(phase)
        self.slow_clients_dropped = Counter(
            "radixfleet_slow_clients_dropped",
            "Client connections dropped for not taking their answer, by the deadline that passed",
            ["reason"],
            registry=r,
        )
        self.body_bytes_held = Gauge(
            "radixfleet_body_bytes_held", "Request body bytes held (read and not yet answered)", registry=r
        )
        self.retries = Counter(
            "radixfleet_retries", "Requests retried on another worker", ["cause"], registry=r
        )
        self.pd_legs = Counter(
            "radixfleet_pd_requests",
            "Requests of a disaggregated (prefill/decode) model, by path: prefill (two legs) or colocated",
            ["path"],
            registry=r,
        )
        self.pd_no_decode = Counter(
            "radixfleet_pd_no_decode",
            "Requests of a disaggregated model answered 503 for want of a decode worker: "
            "before (none at arrival) or after_prefill (gone during the prefill leg)",
            ["when"],
            registry=r,
        )
        self.pd_handoffs = Counter(
            "radixfleet_pd_kv_handoffs",
            "Prefill legs answered, by what they handed the decode leg: params "
            "(kv_transfer_params: the decode worker pulls the KV), none (no connector: "
            "the decode worker prefills again), bootstrap (SGLang: a room, both legs at once)",
            ["outcome"],
            registry=r,
        )
        self.pd_prefill = Histogram(
            "radixfleet_pd_prefill_seconds",
            "A prefill leg: sent to its answer with the KV transfer parameters (vLLM's protocol)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "radixfleet_in_flight", "Requests in flight per worker", ["worker"], registry=r
        )
        self.breaker = Gauge(
            "radixfleet_worker_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            ["worker"],
            registry=r,
        )
        self.healthy = Gauge(
            "radixfleet_worker_healthy", "1 if the worker passes health checks", ["worker"], registry=r
        )
        self.index_nodes = Gauge("radixfleet_index_nodes", "Prefix index nodes", registry=r)
        self.index_entries = Gauge(
            "radixfleet_index_holder_entries", "Prefix index (node, worker) entries", registry=r
        )
        self.index_bytes = Gauge("radixfleet_index_bytes", "Prefix index estimated bytes", registry=r)
        self.index_evicted = Counter(
            "radixfleet_index_evicted_entries", "Entries evicted to stay within the budget", registry=r
        )
        self._evicted_seen = 0  # the index's cumulative count at the last scrape
        self.events = Counter("radixfleet_events_applied", "Agent events applied", ["type"], registry=r)
        self.batches = Counter(
            "radixfleet_event_batches", "Agent event batches by answer", ["status"], registry=r
        )
        self.peer_hangups = Counter(
            "radixfleet_peer_hangups",
            "Agent API requests whose peer hung up before its request was read",
            ["path"],
            registry=r,
        )
        self.workers_reaped = Counter(
            "radixfleet_workers_reaped",
            "Self-registered workers removed after staying unhealthy for registration.unhealthy_grace_s",
            registry=r,
        )
        self._reaped_seen = 0
        self.registrations_refused = Counter(
            "radixfleet_registrations_refused", "Agent registrations refused", ["reason"], registry=r
        )
        self.hot_count = Gauge("radixfleet_hot_prefixes", "Hot prefixes tracked", registry=r)
        self.hot_rate = Gauge(
            "radixfleet_hot_prefix_rate",
            "Decayed requests/s of the hot prefixes, by rank (1 = hottest)",
            ["rank"],
            registry=r,
        )
        self.hot_replicas = Gauge(
            "radixfleet_hot_prefix_replicas", "Holders of the hot prefixes, by rank", ["rank"], registry=r
        )
        self.warmups = Counter("radixfleet_warmups", "Hot-root warm-up requests", ["status"], registry=r)
        self.prefetch = Counter(
            "radixfleet_prefetch",
            "Prefetches by outcome (radixfleet.server.prefetch)",
            ["outcome"],
            registry=r,
        )
        self.prefetch_dropped = Counter(
            "radixfleet_prefetch_dropped", "Prefetches refused with 429, by cause", ["cause"], registry=r
        )
        self.prefetch_tokens = Counter(
            "radixfleet_prefetch_tokens", "Uncached prompt tokens prefetches sent to workers", registry=r
        )
        self.reloads = Counter("radixfleet_config_reloads", "Configuration reloads applied", registry=r)
        self.reload_failures = Counter(
            "radixfleet_config_reload_failures",
            "Configuration reloads refused, the running config kept, by reason (radixfleet.config.reload)",
            ["reason"],
            registry=r,
        )
        for reason in FAILURE_REASONS:
            self.reload_failures.labels(reason=reason)  # every series exported from the start
        self.autoscale_desired = Gauge(
            "radixfleet_autoscale_desired_workers",
            "Workers the fleet needs now (radixfleet.fleet.scaling_signal: hot-prefix rates and holders, KV, "
            "backlog)",
            registry=r,
        )
        self.autoscale_parts = Gauge(
            "radixfleet_autoscale_workers",
            "Parts of the autoscaling signal, in workers",
            ["part"],
            registry=r,
        )
        self._req_children: dict[tuple, Counter] = {}
        self._answer_children: dict[tuple, tuple] = {}
        self._attempt_children: dict[tuple, Counter] = {}
        self._event_children = {
            t: self.events.labels(t)
            for t in ("stored", "removed", "cleared", "snapshot", "load", "unknown_tier")
        }
        self.observe_ttfb = self.ttfb.observe
        self.observe_ttft = self.ttft.observe
        self.observe_latency = self.latency.observe
        self.observe_matched = self.matched.observe

    def request_done(self, worker: str, status: int, reason: str) -> None:
        """A client request answered by ``worker``'s last try: one client outcome and
        one attempt."""
        self.outcome(worker, status, reason)
        self.attempt(worker, status)

    def outcome(self, worker: str, status: int, reason: str) -> None:
        """A client request answered by ``worker`` (without counting a try)."""
        key = (worker, status, reason)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self.requests.labels(worker, str(status), reason)
        c.inc()

    def attempt(self, worker: str, outcome: int | str) -> None:
        """One try on ``worker``: its status, or why it failed (connect, timeout, payload)."""
        key = (worker, outcome)
        c = self._attempt_children.get(key)
        if c is None:
            c = self._attempt_children[key] = self.attempts.labels(worker, str(outcome))
        c.inc()

    def answered(
        self,
        worker: str,
        model: str,
        ok: bool | None,
        usage: tuple[int, int] | None,
        quality: tuple[int, int, int | None] | None = None,
    ) -> None:
        """One try on ``worker`` ended: ``ok`` True (answered, any status), False (the
        worker failed), None (the client left); ``usage`` (prompt, cached tokens)
        where the worker reported it, and with it the try's ``quality`` (available,
        predicted, delivered tokens: ``radixfleet.route.decisions.Quality``)."""
        outcome = "answered" if ok else "failed" if ok is False else "gone"
        key = (worker, model, outcome)
        c = self._answer_children.get(key)
        if c is None:
            c = self._answer_children[key] = (
                self.worker_requests.labels(worker, model, outcome),
                self.prompt_tokens.labels(worker, model),
                self.cached_tokens.labels(worker, model),
                self.available_tokens.labels(worker, model),
                self.predicted_tokens.labels(worker, model),
            )
        c[0].inc()
        if usage is not None:
            c[1].inc(usage[0])
            c[2].inc(usage[1])
            if quality is not None:
                c[3].inc(quality[0])
                c[4].inc(quality[1])

    def event_applied(self, kind: str, n: int = 1) -> None:
        self._event_children[kind].inc(n)

    def refresh(self, pool, index, now: float, hot_k: int) -> None:
        """Copies pool and index state into the gauges (at scrape time)."""
        for g in (
            self.in_flight,
            self.breaker,
            self.healthy,
            self.worker_queued,
            self.worker_running,
            self.worker_kv,
            self.worker_batch_limit,
        ):
            g.clear()
        for w in pool:
            self.in_flight.labels(w.id).set(w.in_flight)
            self.breaker.labels(w.id).set(BREAKER_GAUGE[w.breaker])
            self.healthy.labels(w.id).set(1 if w.health is HealthState.HEALTHY else 0)
            ld = w.load
            if ld is not None and now < w.load_until:
                self.worker_queued.labels(w.id).set(ld.queued_requests)
                self.worker_running.labels(w.id).set(ld.running_requests)
                if ld.kv_capacity_tokens > 0:
                    self.worker_kv.labels(w.id).set(min(1.0, ld.kv_used_tokens / ld.kv_capacity_tokens))
            if w.mark.limit:
                self.worker_batch_limit.labels(w.id).set(w.mark.limit)
        if pool.reaped > self._reaped_seen:
            self.workers_reaped.inc(pool.reaped - self._reaped_seen)
        self._reaped_seen = pool.reaped
        st = index.stats()
        self.index_nodes.set(st.nodes)
        self.index_entries.set(st.holder_entries)
        self.index_bytes.set(st.est_bytes)
        if st.evicted_entries > self._evicted_seen:
            self.index_evicted.inc(st.evicted_entries - self._evicted_seen)
        self._evicted_seen = st.evicted_entries
        self.hot_rate.clear()
        self.hot_replicas.clear()
        hot = index.hot_prefixes(now, k=hot_k)
        self.hot_count.set(len(hot))
        for rank, hp in enumerate(hot, 1):
            self.hot_rate.labels(str(rank)).set(hp.rate)
            self.hot_replicas.labels(str(rank)).set(len(hp.holders))

    def set_autoscale(self, signal) -> None:
        """Copies a ``radixfleet.fleet.scaling_signal.ScaleSignal`` into the gauges (at scrape time)."""
        self.autoscale_desired.set(signal.desired)
        for part in ("compute", "holders", "kv", "queue", "current"):
            self.autoscale_parts.labels(part).set(getattr(signal, part))

    def watch_traffic_log(self, traffic_log) -> None:
        """Exports a ``radixfleet.server.traffic_log.TrafficLog``'s counters, read at each scrape."""
        self.registry.register(_TrafficLogCollector(traffic_log))

    def watch_tracing(self, tracing) -> None:
        """Exports the counters of the ``radixfleet.common.tracing.Tracing`` that ``tracing()``
        returns at each scrape (none while it returns None)."""
        self.registry.register(_TracingCollector(tracing))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TrafficLogCollector:
    """Reads ``TrafficLog.stats()`` when scraped (the log keeps its own counters)."""

    def __init__(self, traffic_log) -> None:
        self._log = traffic_log

    def collect(self):
        st = self._log.stats()
        c = CounterMetricFamily(
            "radixfleet_traffic_log_records", "Traffic log records by outcome", labels=["outcome"]
        )
        for outcome in ("written", "dropped_full", "dropped_error", "sampled_out"):
            c.add_metric([outcome], getattr(st, outcome))
        yield c
        yield CounterMetricFamily(
            "radixfleet_traffic_log_write_errors", "Traffic log write errors", value=st.write_errors
        )
        yield GaugeMetricFamily(
            "radixfleet_traffic_log_queued", "Traffic log records waiting for the writer", value=st.queued
        )
        yield GaugeMetricFamily(
            "radixfleet_traffic_log_writing",
            "1 while the traffic log writes, 0 while a write error stopped it (until a retry succeeds)",
            value=st.writing,
        )


class _TracingCollector:
    """Reads ``Tracing.stats()`` when scraped (the tracer keeps its own counters)."""

    def __init__(self, tracing) -> None:
        self._tracing = tracing

    def describe(self):
        return []

    def collect(self):
        t = self._tracing()
        if t is None:
            return
        st = t.stats()
        c = CounterMetricFamily("radixfleet_tracing_spans", "Trace spans by outcome", labels=["outcome"])
        for outcome in ("exported", "dropped_queue_full", "dropped_export_failed"):
            c.add_metric([outcome], st[outcome])
        yield c
        yield GaugeMetricFamily(
            "radixfleet_tracing_queued_spans", "Trace spans waiting for the export thread", value=st["queued"]
        )
