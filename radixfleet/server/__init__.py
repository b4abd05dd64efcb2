"""The router's servers: the data plane's client and upstream wires, the aiohttp app
(admin, agent API, metrics), intake, tracing and the traffic log, ``radixfleet router``.

Modules:

- ``admin_api``: The admin API: the worker list, the index and policy state, reload.
- ``admission``: The router's concurrency limit: ``Admission``, a slot per request in flight and a
  bounded FIFO queue for the rest (``limits.max_concurrency``, ``limits.max_queue``,
  ``limits.queue_timeout_s``); a request that finds the queue full, or waits past the timeout, is
  refused 429 + Retry-After (``limits.retry_after_s``).
- ``agent_api``: The agent API (docs/DESIGN.md contract 2): agents announce themselves and push
  their cache events and load.
- ``aiohttp_exchange``: The data plane's exchange (see ``radixfleet.server.dataplane``) over an
  aiohttp request: the whole API on one aiohttp app (``Router.app``: embedding, tests, ``radixfleet
  gateway``'s router), where the data port's raw front (``radixfleet.server.front_exchange``) is not
  the server.
- ``answers``: What the data plane answers a client for a worker's answer or failure: the headers
  naming an answer, the OpenAI error shapes (``radixfleet.wire.errors.error_body``) of a worker's
  error and of each failure cause, naming no worker, and the usage a non-streamed answer reports.
- ``app``: The router's composition root and its aiohttp application: builds the index, pool,
  policy, engines, feedback, data plane, bus and discovery from the config, runs their lifecycle,
  serves the probes and metrics, and applies reloads.
- ``attempts``: One client request's attempts on its workers: ``Attempts`` (the data plane's).
- ``auth``: Identities: the admin and agent APIs' exposure rule, who may read ``/metrics``, tenants
  for the data plane (bearer tokens themselves: ``radixfleet.common.auth``).
- ``cli``: ``radixfleet router``: run the cache-aware router.
- ``context``: One client request on the data plane, once read: ``RequestContext`` (made by
  ``DataPlane.context_of``; what each of its attempts and legs reads).
- ``dataplane``: The data plane: one client request from admission to its last byte.
- ``edge``: What crosses the client edge of the data plane: the fields a client may not set and an
  answer may not carry back.
- ``front``: The data port's wire (``FrontServer``): a raw HTTP/1.1 server, its bytes parsed by one
  httptools.HttpRequestParser per connection, that serves every request of the data port itself —
  the data-plane POST paths and the few others clients and agents use
  (``radixfleet.server.app.RouterServer`` names them).
- ``front_exchange``: One request's exchange on a raw front connection
  (``radixfleet.server.front``): its head and body as parsed, and its answer written to the client —
  a reply with its length, or a stream (chunked; for HTTP/1.0 ended by the close) whose writes wait
  while the client is slow to take them (``_FrontConn.drain``, within
  ``radixfleet.server.slow_clients``).
- ``healthcheck``: The container's HEALTHCHECK: ``python -m radixfleet.server.healthcheck [URL]``.
- ``hops``: The router's mark on every request it sends a worker, so that one coming back is
  refused.
- ``http_api``: JSON answers and guarded handlers: the admin listener's aiohttp endpoints
  (``guarded``), and the data port's others (agent API, probes, ``/v1/models``) as handlers of an
  exchange (``answered``: the raw front's, or the aiohttp app's for an embedded router).
- ``intake``: What a client may hold of the router before its request is admitted.
- ``ledger``: What one routed request owes the router after its pick: ``RequestLedger``.
- ``metrics``: The router's Prometheus metrics, in a registry of its own (one per app, so two
  routers in one process — tests — never share counters).
- ``prefetch``: Prefetch: a cache fill with a predicted key (``POST /v1/prefetch``).
- ``screen``: What refuses a data-plane request before its body costs the event loop anything.
- ``slow_clients``: The client-side deadlines: how long the router waits for a client to take its
  answer.
- ``sse``: Watching an OpenAI-style SSE response as it passes through the router.
- ``tracing``: A data-plane request's trace (``tracing`` in the YAML; the ``tracing`` extra).
- ``traffic_log``: The traffic log: one privacy-safe JSON line per routed request (YAML
  ``traffic_log``).
- ``upstream``: The data plane's upstream wire: a lean HTTP/1.1 client with keep-alive connection
  pools (``UpstreamPool``) that forwards a request to a worker.
- ``warm``: What the data plane sends a worker that no client waits on: ``Warmer``.
"""
