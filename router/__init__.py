"""The router: a cache-aware reverse proxy in front of a pool of workers.

Modules (ARCHITECTURE.md has the request flow and a row for each)::

    cli           ``radixfleet router``; app: the ``Router`` composition root
    front, front_exchange  the raw HTTP/1.1 listener of the data port, one request's
                  answer on it; intake: what a client may hold before admission
                  (body budget, connection cap); slow_clients: how long it may take
                  to read its answer (both listeners)
    screen        what is refused before a body is parsed and keyed (head, raw bytes)
    route         the route core, sans I/O: views, keys, admission, choice, placement
    dataplane     one request's I/O around the route core: body, verdict, refusals;
                  admission: its concurrency slot; context: the request once read
    attempts      its tries on workers, each told to a ledger; answers: what a client
                  gets back for a worker's answer or failure
    warm          what no client waits on: hot-root warm-ups and prefetches
    pd            disaggregated prefill/decode: a request's prefill and decode legs
    ledger        one routed attempt's bookkeeping after its pick (load released once)
    upstream, sse the HTTP/1.1 client to workers; SSE pass-through, first content token
    edge          what a client may not set (the P/D legs, ranks) and no answer carries back
    prefix_index  the approximate per-worker prefix index (one global budget)
    index_eviction, index_tiers  its eviction (budget, fair share, caps); its colder tiers
    pool, served  workers, health, breakers, load at pick time; who serves which model
    warmup        the hot-root warm-up gate
    prefetch      POST /v1/prefetch: its prefill budget per tenant, used/wasted ledger
    shedding      429 when every eligible worker reports saturation
    tenancy, rate_limit  priority classes (the shedding bound's factor) and rate
                  limits per tenant and API key (token buckets)
    admission_queue  at saturation, refused requests wait: by class, then fair share
    fair_share    tenants under their share of what was admitted lately: shed later
    feedback      agents' event batches applied to the index and the pool
    registration  who may register a worker, at which addresses (never the router)
    hops          the router's mark on what it sends: a request that comes back is 508
    config, reload  the YAML schema and ``check-config``; hot reload
    config_reference  deploy/README's key tables generated from the schema
    auth, http_api, admin_api, agent_api  tokens, tenants, who reads /metrics; the
                  admin listener's endpoints and the data port's JSON handlers
    metrics, traffic_log, scaling_signal, healthcheck  observability and the scaling signal
    decisions     routing quality (available, predicted, delivered) and the recent
                  decisions with their candidates (GET /admin/decisions)
    tracing       a data-plane request's OpenTelemetry spans (the tracing extra)
    engines/      one adapter per worker kind (agent, vLLM, SGLang, OpenAI)
    bus/          router replicas on NATS JetStream
    discovery/    workers from Kubernetes EndpointSlices or DNS
    epp/          the endpoint picker of a Gateway API inference gateway (Envoy ext_proc)
"""
