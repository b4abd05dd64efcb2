"""The base install runs the router and the agents; a feature whose pip extra is not
installed fails with one line naming the extra, not an ImportError traceback.

``base_install()`` makes this process look like a base install: every module of the
optional extras (pyproject.toml: engines, k8s, bus, plots, tracing, gateway) is blocked (``None`` in
``sys.modules`` makes its import fail, as a missing package does) and the project's
packages are imported afresh under that; they are put back afterwards. No
process is started, so this stays in the fast tier.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager

import pytest

OURS = ("radixfleet", "radixfleet_tools")
#: the top-level modules each extra installs (pyproject.toml [project.optional-dependencies])
EXTRA_MODULES = {
    "engines": ("zmq", "msgpack", "transformers", "huggingface_hub", "jinja2", "tokenizers", "fastokens"),
    "k8s": ("kubernetes_asyncio",),
    "bus": ("nats", "nkeys"),
    "plots": ("matplotlib",),
    "tracing": ("opentelemetry",),
    "gateway": ("grpc", "grpc_health", "envoy"),
}
BLOCKED = tuple(m for mods in EXTRA_MODULES.values() for m in mods)


@contextmanager
def base_install():
    saved = dict(sys.modules)
    try:
        for name in list(sys.modules):
            if name.split(".")[0] in OURS + BLOCKED:
                del sys.modules[name]
        for name in BLOCKED:
            sys.modules[name] = None  # type: ignore[assignment]
        yield
    finally:  # third-party modules first imported meanwhile stay (numpy loads once)
        for name in list(sys.modules):
            if name.split(".")[0] in OURS + BLOCKED:
                del sys.modules[name]
        sys.modules.update(saved)


def one_line_naming(err: str, extra: str) -> None:
    assert err.endswith(f"pip install 'radixfleet[{extra}]'"), err
    assert "\n" not in err and "Traceback" not in err, err


def test_the_blocker_blocks():
    with base_install(), pytest.raises(ImportError):
        importlib.import_module("nats")


@pytest.mark.parametrize(
    "module",
    [
        "radixfleet.cli",
        "radixfleet.server.cli",
        "radixfleet.server.app",
        "radixfleet.config.reload",
        "radixfleet.engines.manager",
        "radixfleet.fleet.discovery.k8s",
        "radixfleet.bus.replica",
        "radixfleet_tools.agent.cli",
        "radixfleet_tools.agent.server",
        "radixfleet_tools.loadtest.local_fleet",
        "radixfleet_tools.loadtest.cli",
        "radixfleet_tools.loadtest.demo",
        "radixfleet_tools.loadtest.simulator.cli",
        "radixfleet_tools.loadtest.analyze",
    ],
)
def test_entry_points_import_on_a_base_install(module):
    with base_install():
        importlib.import_module(module)


def test_check_config_of_an_agent_fleet_passes_on_a_base_install(tmp_path, capsys):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers:\n  - url: http://127.0.0.1:9001\n    kind: agent\n")
    with base_install():
        from radixfleet.cli import main

        assert main(["check-config", str(cfg)]) == 0, capsys.readouterr().err


def test_the_cli_says_which_extra_to_install(tmp_path, capsys):
    with base_install():
        from radixfleet.cli import main

        assert main(["demo", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("radixfleet demo: error: the 'plots' extra is not installed"), err
    one_line_naming(err, "plots")
    assert not (tmp_path / "out" / "report.json").exists()  # refused before the run


def test_the_gateway_says_which_extra_to_install(capsys):
    with base_install():
        from radixfleet.cli import main

        assert main(["gateway", "--worker", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("radixfleet gateway: error: the 'gateway' extra is not installed"), err
    one_line_naming(err, "gateway")


def test_each_feature_names_its_extra():
    with base_install():
        from prometheus_client import CollectorRegistry

        from radixfleet.common.bus_connection import BusConnection, BusMetrics
        from radixfleet.config import K8sDiscoveryConfig
        from radixfleet.fleet.discovery.base import DiscoveryMetrics
        from radixfleet.fleet.discovery.k8s import KubernetesSource
        from radixfleet.wire.errors import MissingExtra

        async def on_up(nc, js) -> None:  # never called
            raise AssertionError

        cases = {
            "bus": lambda: BusConnection(
                "nats://127.0.0.1:4222", name="t", on_up=on_up, metrics=BusMetrics(CollectorRegistry())
            ),
            "k8s": lambda: KubernetesSource(
                K8sDiscoveryConfig(), DiscoveryMetrics(CollectorRegistry())
            )._client(),
            "engines": lambda: importlib.import_module("radixfleet.engines.chat_render"),
            "plots": lambda: importlib.import_module("radixfleet_tools.loadtest.report").write_plots(
                [], "x", {}
            ),
            "tracing": lambda: importlib.import_module("radixfleet.server.tracing"),
            "gateway": lambda: importlib.import_module("radixfleet.gateway.protocol").pb(),
        }
        for extra, make in cases.items():
            with pytest.raises(MissingExtra) as got:
                make()
            assert got.value.extra == extra
            assert isinstance(got.value, ImportError)
            one_line_naming(str(got.value), extra)


def test_check_config_with_tracing_names_the_extra_on_a_base_install(tmp_path, capsys):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://127.0.0.1:9001]\ntracing: {enabled: true}\n")
    with base_install():
        from radixfleet.cli import main

        assert main(["check-config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    one_line_naming(err, "tracing")


class _Exchange:
    """The least exchange the data plane serves (radixfleet.server.dataplane's docstring)."""

    def __init__(self, body: bytes) -> None:
        self.headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        self._body = body
        self.replies: list[int] = []

    async def body(self, limit: int) -> bytes:
        return self._body

    def reply(self, status, body, content_type, extra) -> None:
        self.replies.append(status)


def test_a_request_with_tracing_off_needs_no_opentelemetry():
    """Tracing off (the default): a request goes through serve, keying and the route
    core (here to a 503: no worker is healthy yet) with OpenTelemetry unimportable."""
    import asyncio

    with base_install():
        from radixfleet.config import parse_config
        from radixfleet.keys import Endpoint
        from radixfleet.server.app import Router

        router = Router(parse_config({"workers": ["http://127.0.0.1:9001"]}))
        ex = _Exchange(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
        asyncio.run(router.dataplane.serve(ex, Endpoint.CHAT))
        assert ex.replies == [503]
        assert sys.modules.get("opentelemetry") is None
