"""``radixfleet up``: a local fleet — N simulated agents and one router — until Ctrl-C.

::

    radixfleet up --agents 4 --agent-model llama-3-8b --gpu h100 --kv-tokens 20000 --port 8000
    radixfleet up --config fleet.yaml

Fleet YAML (every key optional; flags given on the command line win)::

    agents: 4                 # how many simulated agents
    model: llama-3-8b
    gpu: h100
    kv_tokens: 20000          # per agent; omit for the GPU's natural capacity
    agent_base_port: 9101     # agents listen on consecutive ports from here (0: free ports)
    agent_args: []            # extra `radixfleet agent` arguments
    router:
      port: 8000
      policy: prefix_load
      config: router.yaml     # optional: `radixfleet router --config FILE` instead of flags
      args: []                # extra `radixfleet router` arguments

The children are ``python -m radixfleet.cli agent|router ...`` processes in their own
process groups, logging to ``--log-dir``; ``Fleet`` stops every one it started on
every exit path (``stop()`` is idempotent). The demo reuses ``Fleet`` and restarts
only the router between policies.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import yaml

from radixfleet.wire.cli_args import DeprecatedAlias
from radixfleet.wire.errors import ConfigError, RunError

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (``up``, the benches and the tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class FleetConfig:
    agents: int = 4
    model: str = "llama-3-8b"
    gpu: str = "h100"
    #: per-agent KV capacity in tokens; 0 = the agent's default for the GPU
    kv_tokens: int = 0
    agent_base_port: int = 0
    agent_args: list[str] = field(default_factory=list)
    router_port: int = 8000
    policy: str = "prefix_load"
    router_config: str | None = None
    router_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    #: agents that send nothing (no registration, no events): the router takes them
    #: as plain OpenAI servers (kind openai), as it would a llama.cpp or a TGI
    plain_workers: bool = False

    def validate(self) -> FleetConfig:
        if type(self.agents) is not int or not 1 <= self.agents <= 64:
            raise ConfigError("agents", f"must be an integer in [1, 64], got {self.agents!r}")
        if type(self.kv_tokens) is not int or self.kv_tokens < 0:
            raise ConfigError("kv_tokens", f"must be a non-negative integer, got {self.kv_tokens!r}")
        for name in ("agent_base_port", "router_port"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v < 65536:
                raise ConfigError(name, f"must be a port number, got {v!r}")
        for name in ("model", "gpu", "policy"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(name, "must be a non-empty string")
        for name in ("agent_args", "router_args"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
                raise ConfigError(name, "must be a list of strings")
        return self


_TOP_KEYS = {"agents", "model", "gpu", "kv_tokens", "agent_base_port", "agent_args", "router", "host"}
_ROUTER_KEYS = {"port": "router_port", "policy": "policy", "config": "router_config", "args": "router_args"}


def load_config(path: str) -> FleetConfig:
    """Reads a fleet YAML file; raises ``ConfigError`` naming the bad field."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError("--config", f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path}: the top level must be a mapping")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"unknown key; valid: {', '.join(sorted(_TOP_KEYS))}")
    kwargs = {k: v for k, v in raw.items() if k != "router"}
    router = raw.get("router") or {}
    if not isinstance(router, dict):
        raise ConfigError("router", "must be a mapping")
    for k, v in router.items():
        if k not in _ROUTER_KEYS:
            raise ConfigError(f"router.{k}", f"unknown key; valid: {', '.join(_ROUTER_KEYS)}")
        kwargs[_ROUTER_KEYS[k]] = v
    cfg = FleetConfig(**kwargs)
    if cfg.router_config is not None:
        cfg.router_config = os.path.join(os.path.dirname(os.path.abspath(path)), cfg.router_config)
    return cfg.validate()


def param_text(value) -> str:
    """A policy parameter's value as ``--policy-param`` reads it back (YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def log_name(name: str) -> str:
    """A run name as a file name: ``prefix_load[tie_s=0]`` -> ``prefix_load_tie_s_0_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "radixfleet.cli", *args]


def wait_registered(admin_url: str, n: int, timeout_s: float = 60.0, registered: bool = True) -> None:
    """Waits until the router whose admin listener is ``admin_url`` lists ``n``
    routable workers whose agents registered
    (so feedback flows before load does; ``registered=False``: routable is enough).
    Returns early without /admin/workers. Raises ``RunError`` after ``timeout_s``:
    load sent before then would meet a router that serves no model yet, and fail
    later with a message that hides why."""
    deadline = time.monotonic() + timeout_s
    listed = "nothing"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(admin_url + "/admin/workers", timeout=1.0)
        except httpx.HTTPError as exc:
            r, listed = None, f"no answer ({exc.__class__.__name__})"
        if r is not None and r.status_code in (401, 403, 404):
            return
        if r is not None and r.status_code == 200:
            body = r.json()
            items = body.get("workers", []) if isinstance(body, dict) else body
            ready = [
                w
                for w in items
                if isinstance(w, dict)
                and w.get("routable", True)
                and (not registered or w.get("epoch", "") is not None)
            ]
            if len(ready) >= n:
                return
            listed = f"{len(ready)} of {len(items)} listed"
        time.sleep(0.2)
    what = "registered, routable" if registered else "routable"
    raise RunError(f"{admin_url} lists fewer than {n} {what} workers after {timeout_s:.0f} s ({listed})")


def _answers(r: httpx.Response) -> bool:
    return r.status_code < 500


class Child:
    """One child process in its own process group, logging to a file: the one
    lifecycle of the fleets, the demo and the benchmarks that start servers.

    ``ready``: what an answer of ``ready_url`` must satisfy (default: any status
    below 500; a router's ``/readiness`` answers 503 until it is ready). ``env``: the
    child's environment (default: this process's)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: str,
        ready_url: str,
        *,
        ready: Callable[[httpx.Response], bool] = _answers,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ready_url = ready_url
        self.ready = ready
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name}: pid before start()"
        return self.proc.pid

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )

    def wait_ready(self, timeout_s: float) -> None:
        proc = self.proc
        assert proc is not None, f"{self.name}: wait_ready() after start()"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ConfigError(
                    self.name,
                    f"exited with status {proc.returncode} at start; last log lines:\n{self.tail()}",
                )
            try:
                if self.ready(httpx.get(self.ready_url, timeout=1.0)):
                    return
            except (httpx.HTTPError, ValueError):  # ValueError: a body ``ready`` could not read
                pass
            time.sleep(0.1)
        raise ConfigError(
            self.name,
            f"{self.ready_url} not ready after {timeout_s:.0f} s; log {self.log_path}, its last lines:\n"
            f"{self.tail()}",
        )

    def tail(self, n: int = 8) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL after ``timeout_s``. Idempotent."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        except ProcessLookupError:
            pass


def stop_children(children: list[Child]) -> None:
    """Stops ``children`` in order. An interrupt while one is stopping (a second
    Ctrl-C) does not leave the others running: every child's stop runs, and the
    interrupt is raised after them."""
    with contextlib.ExitStack() as stack:
        for child in reversed(children):  # the stack runs them last-in first
            stack.callback(child.stop)


class Fleet:
    """N agents and (optionally) a router, started and stopped together.

    ``with Fleet(cfg) as fleet:`` starts the agents and the router and waits until
    each answers; leaving the block stops them all (also on errors and Ctrl-C).
    """

    def __init__(
        self,
        cfg: FleetConfig,
        *,
        log_dir: str | None = None,
        start_router: bool = True,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.cfg = cfg.validate()
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="radixfleet-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.start_router_on_enter = start_router
        self.ready_timeout_s = ready_timeout_s
        self.agents: list[Child] = []
        self.router: Child | None = None
        self.router_port = cfg.router_port or free_port()
        #: the router's admin listener (--admin-port): /admin/workers, /metrics
        self.admin_port = free_port()
        self.agent_ports = [
            cfg.agent_base_port + i if cfg.agent_base_port else free_port() for i in range(cfg.agents)
        ]

    @property
    def router_url(self) -> str:
        return f"http://{self.cfg.host}:{self.router_port}"

    @property
    def admin_url(self) -> str:
        """The router's admin listener (a radixfleet router; smg has none)."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def agent_urls(self) -> list[str]:
        return [f"http://{self.cfg.host}:{p}" for p in self.agent_ports]

    def worker_id(self, i: int) -> str:
        return f"w{i}"

    def start_agents(self) -> None:
        c = self.cfg
        for i, (port, url) in enumerate(zip(self.agent_ports, self.agent_urls)):
            argv = cli_argv(
                "agent",
                "--engine",
                "sim",
                "--agent-model",
                c.model,
                "--gpu",
                c.gpu,
                "--host",
                c.host,
                "--port",
                str(port),
                "--worker-id",
                self.worker_id(i),
                *([] if c.plain_workers else ["--router", self.router_url]),
                *c.agent_args,
            )
            if c.kv_tokens:
                argv += ["--kv-tokens", str(c.kv_tokens)]
            child = Child(
                f"agent {self.worker_id(i)}",
                argv,
                os.path.join(self.log_dir, f"agent-{i}.log"),
                url + "/health",
            )
            child.start()
            self.agents.append(child)
        for child in self.agents:
            child.wait_ready(self.ready_timeout_s)

    def start_router(
        self, policy: str | None = None, params: dict | None = None, name: str | None = None
    ) -> None:
        """(Re)starts the router with ``policy`` (default: the config's) and its
        ``params`` (quick start ``--policy-param``s; not with a router config file).
        ``name`` names its log (default: the policy)."""
        self.stop_router()
        c = self.cfg
        if c.router_config:
            if params:
                raise ConfigError(
                    "--policies", "policy parameters come from the router config file here, not from the arm"
                )
            argv = cli_argv(
                "router",
                "--config",
                c.router_config,
                "--port",
                str(self.router_port),
                "--admin-port",
                str(self.admin_port),
                "--worker-header",
                "--match-header",
                *c.router_args,
            )
        else:
            argv = cli_argv(
                "router",
                "--host",
                c.host,
                "--port",
                str(self.router_port),
                "--admin-port",
                str(self.admin_port),
                "--policy",
                policy or c.policy,
                "--worker-header",  # the load generator's per-worker figures read it
                "--match-header",  # and its per-request routing quality
                *c.router_args,
            )
            for k, v in (params or {}).items():
                argv += ["--policy-param", f"{k}={param_text(v)}"]
            for i, url in enumerate(self.agent_urls):
                if c.plain_workers:
                    # what the router knows of an engine that sends nothing: its
                    # URL and KV capacity (the approximate index ages at it)
                    argv += [
                        "--worker",
                        f"url={url},id={self.worker_id(i)},kind=openai"
                        + (f",kv_capacity_tokens={c.kv_tokens}" if c.kv_tokens else ""),
                    ]
                else:
                    argv += ["--worker", url]
        name = name or policy or c.policy
        self.router = Child(
            f"router ({name})",
            argv,
            os.path.join(self.log_dir, f"router-{log_name(name)}.log"),
            self.router_url + "/v1/models",
        )
        self.router.start()
        self.router.wait_ready(self.ready_timeout_s)
        wait_registered(
            self.admin_url, len(self.agents), self.ready_timeout_s, registered=not c.plain_workers
        )

    def start_smg(self, launch: list[str] | None = None, name: str = "smg") -> None:
        """(Re)starts SGLang's gateway, ``smg``, on the router's port in front of the
        agents, and waits until it lists them all. ``launch``: its policy flags
        (``radixfleet_tools.loadtest.smg.launch_args``; default cache_aware at its defaults); ``name``
        names its log. Raises ``RunError`` when its binary is missing."""
        from radixfleet_tools.loadtest.smg import launch_args, require_smg

        self.stop_router()
        launch = launch if launch is not None else launch_args({})
        argv = [
            require_smg(),
            "launch",
            "--host",
            self.cfg.host,
            "--port",
            str(self.router_port),
            "--worker-urls",
            *self.agent_urls,
            *launch,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "error",
        ]
        self.router = Child(
            f"smg ({' '.join(launch)})",
            argv,
            os.path.join(self.log_dir, f"{log_name(name)}.log"),
            self.router_url + "/health",
        )
        self.router.start()
        self.router.wait_ready(self.ready_timeout_s)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:  # smg adds workers after /health answers
            try:
                r = httpx.get(self.router_url + "/workers", timeout=1.0)
                if r.status_code == 200 and len(r.json().get("workers", [])) >= len(self.agents):
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.2)
        raise ConfigError(
            self.router.name,
            f"lists fewer than {len(self.agents)} workers "
            f"after {self.ready_timeout_s:.0f} s; log: {self.router.log_path}",
        )

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def check_ports(self) -> None:
        """Raises ``ConfigError`` (one line, exit 2) if a port the fleet was told to use
        is taken, before anything starts: agents started anyway would register with
        whatever router holds the router's port."""
        c = self.cfg
        wanted = []
        if c.router_port:
            wanted.append(("--port", self.router_port))
        if c.agent_base_port:
            wanted += [("--agent-base-port", p) for p in self.agent_ports]
        for flag, port in wanted:
            with socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET, socket.SOCK_STREAM) as s:
                # as the servers bind: a port in TIME_WAIT is free, a listener is not
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((c.host, port))
                except OSError as exc:
                    raise ConfigError(
                        flag, f"port {port} on {c.host} is taken ({exc.strerror or exc}); choose another"
                    ) from None

    def __enter__(self) -> Fleet:
        try:
            self.check_ports()
            self.start_agents()
            if self.start_router_on_enter:
                self.start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops the router, then every agent. Idempotent (``stop_children``)."""
        stop_children([*([self.router] if self.router else []), *self.agents])
        self.router = None

    def dead(self) -> list[str]:
        return [c.name for c in [*self.agents, *([self.router] if self.router else [])] if not c.alive()]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="fleet YAML with any of the keys agents, model, gpu, kv_tokens, "
        "policy, router_port, agent_base_port (the flags below override it)",
    )
    parser.add_argument("--agents", type=int, help="number of simulated agents (default 4)")
    parser.add_argument(
        "--agent-model", dest="model", help="model preset of every agent (default llama-3-8b)"
    )
    parser.add_argument("--model", dest="model", action=DeprecatedAlias, use="--agent-model")
    parser.add_argument("--gpu", help="GPU preset of every agent (default h100)")
    parser.add_argument("--kv-tokens", type=int, help="per-agent KV capacity in tokens")
    parser.add_argument("--policy", help="router policy (default prefix_load)")
    parser.add_argument("--port", type=int, help="router port (default 8000)")
    parser.add_argument("--agent-base-port", type=int, help="first agent port (default: free ports)")
    parser.add_argument("--log-dir", help="where the children log (default: a temp dir)")


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    cfg = load_config(args.config) if args.config else FleetConfig()
    for flag, attr in (
        ("agents", "agents"),
        ("model", "model"),
        ("gpu", "gpu"),
        ("kv_tokens", "kv_tokens"),
        ("policy", "policy"),
        ("port", "router_port"),
        ("agent_base_port", "agent_base_port"),
    ):
        v = getattr(args, flag, None)
        if v is not None:
            setattr(cfg, attr, v)
    return cfg.validate()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per readiness poll
    cfg = config_from_args(args)
    fleet = Fleet(cfg, log_dir=args.log_dir)
    try:
        with fleet:
            print(f"router  {fleet.router_url}  (policy {cfg.policy}; admin {fleet.admin_url})", flush=True)
            for i, url in enumerate(fleet.agent_urls):
                print(
                    f"agent   {fleet.worker_id(i)}  {url}  ({cfg.model} on {cfg.gpu}"
                    f"{f', {cfg.kv_tokens} KV tokens' if cfg.kv_tokens else ''})",
                    flush=True,
                )
            print(f"logs    {fleet.log_dir}\nserving until Ctrl-C", flush=True)
            while True:
                dead = fleet.dead()
                if dead:
                    print(
                        f"radixfleet up: error: {', '.join(dead)} exited; stopping the fleet", file=sys.stderr
                    )
                    return 1
                time.sleep(0.5)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (radixfleet.cli turns it into one)
        print("stopping the fleet", flush=True)
        return 0
