"""radixfleet: a fleet-level, cache-aware router for LLM inference.

Modules:

- ``cli``: The one command line, ``radixfleet`` (contract 5, docs/DESIGN.md).
- ``keys``: Prefix keys: the one way a request becomes a chain of block hashes (contract 1,
  docs/DESIGN.md).
- ``bus``: The router's side of the event bus shared by router replicas and agents (contract 11,
  docs/DESIGN.md), on NATS JetStream: ``remote_load`` (other replicas' in-flight counts),
  ``replica`` (a router replica's consumer and publisher).
- ``common``: What every radixfleet server (the router and the worker agent) is built from, so
  neither imports the other: JSON error answers (``http_errors``), bounded JSON bodies
  (``jsonbody``), bearer tokens and the loopback rule (``auth``), per-deployment tenant salts and
  the signed tenant header (``tenancy``), the standard metrics collectors (``metrics``), the NATS
  connection the bus runs on (``bus_connection``), the background loops' stop and backoff
  (``background``) and OpenTelemetry traces, the ``tracing`` extra's (``tracing``; their OTLP
  protobuf encoding: ``otlp``).
- ``config``: The router's YAML configuration: one declared schema, validated into frozen
  dataclasses.
- ``engines``: The inference engines a worker can be: our agent, vLLM, SGLang, or any OpenAI-
  compatible server (contract 7, docs/DESIGN.md).
- ``fleet``: The workers: the pool, registration, discovery and the autoscaling signal.
- ``gateway``: radixfleet as the endpoint picker (EPP) of a Gateway API inference gateway.
- ``index``: The prefix index and the feedback that keeps it true (contracts 2 and 9).
- ``policies``: Routing policies: pure decisions over typed, read-only views (contract 3,
  docs/DESIGN.md).
- ``route``: One request's decision: the sans-I/O route core (``core``) and what it consults
  (shedding, tenancy, rate limits, fair share, the admission queue, P/D, warm-ups).
- ``server``: The router's servers: the data plane's client and upstream wires, the aiohttp app
  (admin, agent API, metrics), intake, tracing and the traffic log, ``radixfleet router``.
- ``wire``: What the router, the policies, the agent and the load generator agree on.
"""
