"""What every radixfleet server (the router and the worker agent) is built from, so
neither imports the other: JSON error answers (``http_errors``), bounded JSON bodies
(``jsonbody``), bearer tokens and the loopback rule (``auth``), per-deployment tenant
salts and the signed tenant header (``tenancy``), the standard metrics collectors
(``metrics``), the NATS connection the bus runs on (``bus_connection``), the
background loops' stop and backoff (``background``) and OpenTelemetry traces, the
``tracing`` extra's (``tracing``; their OTLP protobuf encoding: ``otlp``).
What travels between them is ``protocol``."""
