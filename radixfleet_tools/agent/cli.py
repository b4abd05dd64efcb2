"""``radixfleet agent``: run a worker agent with the simulated GPU engine.

    radixfleet agent --engine sim --model llama-3-8b --gpu h100 [--tp N] [--kv-tokens N]
                     [--host 127.0.0.1] --port P [--router URL ...] [--worker-id ID]
                     [--block-bytes N] [--role prefill|decode|both] [--kv-link nvlink|rdma]
                     [--admission MODE] [--seed S]
                     [--page-size N] [--disable-radix-cache] [--advertise-url URL]
                     [--otlp-traces-endpoint URL]
                     [--dram-tokens TOKENS|Nx [--dram-admit-hits N]]
                     [--bus nats://HOST:4222|tls://HOST:4222 [--bus-prefix P]
                      [--bus-user U --bus-password-env VAR | --bus-token-file F |
                       --bus-nkey-seed-file F | --bus-creds-file F]
                      [--bus-tls-ca-file F] [--bus-tls-cert-file F --bus-tls-key-file F]]

With ``--bus``, every publication is signed with ``RADIXFLEET_AGENT_TOKEN`` (required
unless the NATS server is on loopback); a missing secret or file is one line, exit 2.

The URL routers reach the agent at (``--advertise-url``, default ``http://HOST:PORT``)
is what it registers. A wildcard ``--host`` (``0.0.0.0``, ``::``) is no address
anyone can reach, so the agent advertises the address this host uses to reach its
first router (or bus) instead, and refuses to start (one line, exit 2, naming
``--advertise-url``) when it cannot find one. The default ``--worker-id`` is the
advertised ``host:port`` (the id a router's ``workers: [{url: ...}]`` entry gets by
default), so agents behind one image keep distinct ids.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from urllib.parse import urlsplit

from aiohttp import web

from radixfleet.common import http_errors
from radixfleet.common.auth import is_loopback
from radixfleet.common.bus_connection import BusCredentials, check_exposure
from radixfleet.keys import DEFAULT_BLOCK_BYTES, check_block_bytes
from radixfleet.wire.bus_wire import check_name, check_url
from radixfleet.wire.cli_args import LOG_LEVELS, DeprecatedAlias, HelpFormatter, log_level
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.identifiers import worker_host
from radixfleet_tools.agent.bus import agent_flag
from radixfleet_tools.agent.cost_model import DEFAULT_LINK, GPUS, LINKS, MODELS, CostModel
from radixfleet_tools.agent.dram_tier import DramConfig, parse_dram_size
from radixfleet_tools.agent.radix_cache import ADMISSION_MODES, AdmissionConfig
from radixfleet_tools.agent.scheduler import ORDERS, SchedulerConfig
from radixfleet_tools.agent.server import AgentConfig, create_app

log = logging.getLogger(__name__)


def _presets_epilog() -> str:
    lines = ["GPU presets:"]
    for g in GPUS.values():
        lines.append(
            f"  {g.name:<10} {g.peak_flops / 1e12:.0f} TFLOP/s bf16, "
            f"{g.hbm_bytes / 1e9:.0f} GB, {g.hbm_bw / 1e12:.2f} TB/s"
        )
    lines.append("model presets:")
    for m in MODELS.values():
        lines.append(
            f"  {m.name:<17} {m.params_total / 1e9:.1f}B params, "
            f"{m.kv_bytes_per_token:,} KV bytes/token{' (MLA)' if m.is_mla else ''}"
        )
    return "\n".join(lines)


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


def _fraction(v: str) -> float:
    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {v!r}") from None
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {f}")
    return f


def _otlp_url(v: str) -> str:
    """An OTLP/HTTP traces URL (``http(s)://HOST[:PORT][/v1/traces]``)."""
    try:
        u = urlsplit(v)
        ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port or 1) > 0
    except ValueError:  # a bad port or IPv6 literal
        ok = False
    if not ok or not v.isascii() or any(c <= " " for c in v):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {v[:200]!r}")
    return v


#: the NATS server's credentials and TLS (radixfleet.common.bus_connection.BusCredentials; the
#: router's bus.auth / bus.tls); secrets only ever from an env var or a file
_BUS_CREDENTIAL_FLAGS = {
    "user": "NATS user (with --bus-password-env or --bus-password-file)",
    "password_env": "env var holding the NATS user's password",
    "password_file": "file holding the NATS user's password",
    "token_env": "env var holding the NATS server's auth token",
    "token_file": "file holding the NATS server's auth token",
    "nkey_seed_file": "file holding an NKey seed (SU...)",
    "creds_file": "NATS .creds file (user JWT and NKey seed)",
    "tls_ca_file": "PEM CA bundle of the NATS server's certificate (tls:// --bus URL)",
    "tls_cert_file": "PEM client certificate for mutual TLS (with --bus-tls-key-file)",
    "tls_key_file": "PEM key of --bus-tls-cert-file",
}


def bus_credentials(args: argparse.Namespace) -> BusCredentials:
    return BusCredentials(**{n: getattr(args, f"bus_{n}") for n in _BUS_CREDENTIAL_FLAGS})


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.epilog = _presets_epilog()
    parser.add_argument(
        "--engine", choices=["sim"], default="sim", help="engine: the simulated GPU (the only one built in)"
    )
    parser.add_argument(
        "--agent-model",
        dest="model",
        choices=list(MODELS),
        default="llama-3-8b",
        help="the simulated model preset (the served name: --served-model-name)",
    )
    parser.add_argument("--model", dest="model", action=DeprecatedAlias, use="--agent-model")
    parser.add_argument("--gpu", choices=list(GPUS), default="h100", help="the simulated GPU preset")
    parser.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree")
    parser.add_argument("--mfu", type=_fraction, default=0.6, help="model FLOPs utilisation")
    parser.add_argument(
        "--kv-tokens",
        type=_positive,
        default=None,
        help="KV pool size in tokens (default: from the GPU and model presets)",
    )
    parser.add_argument(
        "--dram-tokens",
        metavar="TOKENS|Nx",
        default=None,
        help="a DRAM KV tier below the pool: TOKENS, or Nx = N times the KV pool (e.g. 4x); "
        "default: none (HBM only)",
    )
    parser.add_argument(
        "--dram-admit-hits",
        type=_positive,
        default=1,
        help="requests that must reach a 256-token chunk before it is written to DRAM (default 1)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the preset name)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=_positive, required=True, help="listen port")
    parser.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="URL",
        help="a router to register with and push events to (repeatable)",
    )
    parser.add_argument(
        "--bus",
        default=None,
        metavar="NATS_URL",
        help="publish events and load once to a NATS JetStream bus that every "
        "router replica reads (nats://host:4222); --router URLs are then "
        "the fallback while the bus is down",
    )
    parser.add_argument(
        "--bus-prefix", default="radixfleet", help="subject prefix (the routers' bus.subject_prefix)"
    )
    parser.add_argument(
        "--bus-snapshot-interval",
        type=float,
        default=30.0,
        metavar="S",
        help="a full snapshot this often (bounds the stream's history)",
    )
    for name, help_ in _BUS_CREDENTIAL_FLAGS.items():
        parser.add_argument(agent_flag(name), default="", metavar=name.rsplit("_", 1)[-1].upper(), help=help_)
    parser.add_argument("--worker-id", default=None, help="default: the advertised host:port")
    parser.add_argument(
        "--advertise-url",
        default=None,
        help="URL routers reach this agent at (default: http://HOST:PORT; "
        "with a wildcard --host, this host's address toward the "
        "router)",
    )
    parser.add_argument(
        "--block-bytes",
        type=_positive,
        default=DEFAULT_BLOCK_BYTES,
        help="router block size in bytes (a multiple of 4)",
    )
    parser.add_argument(
        "--role",
        choices=("prefill", "decode", "both"),
        default="both",
        help="the role it registers with: a disaggregated fleet's prefill or decode side, or both",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        type=_otlp_url,
        default=None,
        metavar="URL",
        help="export an OpenTelemetry span per request (vLLM's llm_request, joined to the "
        "router's through traceparent) to this OTLP/HTTP collector URL; needs pip install "
        "'radixfleet[tracing]' (default: off)",
    )
    parser.add_argument(
        "--kv-link",
        choices=tuple(LINKS),
        default=DEFAULT_LINK,
        help="the link a remote prefill's KV arrives over (vLLM's kv_transfer_params "
        f"decode leg); the simulator's presets (default {DEFAULT_LINK})",
    )
    parser.add_argument(
        "--admission", choices=ADMISSION_MODES, default="always", help="which prompts the prefix cache keeps"
    )
    parser.add_argument(
        "--min-prefix-tokens", type=int, default=64, help="--admission min_prefix: shortest sequence kept"
    )
    parser.add_argument(
        "--protected-fraction",
        type=_fraction,
        default=0.5,
        help="--admission protected: share of the pool for proven prefixes",
    )
    parser.add_argument(
        "--schedule",
        choices=ORDERS,
        default="fcfs",
        help="waiting order: fcfs, lpm (longest cached prefix first) or priority (the body's "
        "integer 'priority', lower first, ties by arrival: vLLM's --scheduling-policy priority; "
        "announced at registration, so routers send each request's class)",
    )
    parser.add_argument(
        "--chunk-tokens", type=_positive, default=8192, help="prefill token budget per step (chunked prefill)"
    )
    parser.add_argument("--max-running", type=_positive, default=256, help="most requests decoding at once")
    parser.add_argument(
        "--max-waiting",
        type=_positive,
        default=None,
        help="requests waiting at most; more are refused with 429 + Retry-After (default: 4 x --max-running)",
    )
    parser.add_argument(
        "--page-size",
        type=_positive,
        default=1,
        help="KV page size in tokens: prefixes are matched and kept in whole "
        "pages (SGLang's --page-size; default 1)",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: every prompt is computed whole (the A/B "
        "baseline for the value of prefix caching)",
    )
    parser.add_argument(
        "--rope-scaling", default=None, help="engine RoPE scaling setting; part of the cache fingerprint"
    )
    parser.add_argument("--seed", type=int, default=0, help="generation seed")
    parser.add_argument(
        "--log-level", type=log_level, default="WARNING", help=f"{', '.join(LOG_LEVELS)} (any case)"
    )


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _address_toward(url: str) -> str | None:
    """The local address this host's routing table picks to reach ``url``'s host (a
    UDP connect sends nothing), or None when the host does not resolve or has no
    route."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            local = s.getsockname()[0]
    except (OSError, IndexError, ValueError):
        return None
    return f"[{local}]" if ":" in local else local


def advertise_url(args: argparse.Namespace) -> str:
    """The URL this agent registers: ``--advertise-url``, else ``http://HOST:PORT``
    with a wildcard HOST replaced by the address toward the first router (or bus;
    with neither it registers nowhere, and the host's name stands in).
    Raises ``ConfigError`` for an advertised host no router could reach."""
    if args.advertise_url:
        parts = urlsplit(args.advertise_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError("--advertise-url", f"expected http://HOST:PORT, got {args.advertise_url!r}")
        _, problem = worker_host(parts.hostname)
        if problem:
            raise ConfigError("--advertise-url", problem)
        return args.advertise_url.rstrip("/")
    host = args.host
    if host in _WILDCARDS:
        target = args.router[0] if args.router else args.bus
        if not target:
            # registers nowhere (a plain worker found by discovery): only its id uses it
            return f"http://{socket.gethostname()}:{args.port}"
        local = _address_toward(target)
        if local is None or local.strip("[]") in _WILDCARDS:
            raise ConfigError(
                "--advertise-url",
                f"--host {host or '(all)'} listens on every "
                "interface, which is no address a router can reach, and this "
                f"host has no route to {target} to take one from: pass "
                f"--advertise-url http://<this host's address>:{args.port}",
            )
        host = local
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{args.port}"


def build_config(args: argparse.Namespace) -> AgentConfig:
    try:
        check_block_bytes(args.block_bytes)
    except ValueError as exc:
        raise ConfigError("--block-bytes", str(exc)) from None
    capacity = args.kv_tokens
    if capacity is None:
        capacity = CostModel(args.model, args.gpu, tp=args.tp, mfu=args.mfu).kv_capacity_tokens()
    dram = None
    if args.dram_tokens is not None:
        try:
            tokens, ratio = parse_dram_size(args.dram_tokens)
            size = int(ratio * capacity) if ratio is not None else int(tokens or 0)
            dram = DramConfig(size, admit_hits=args.dram_admit_hits)
        except ValueError as exc:
            raise ConfigError("--dram-tokens", str(exc)) from None
    if args.page_size > args.chunk_tokens:
        raise ConfigError(
            "--page-size", f"{args.page_size} is larger than --chunk-tokens {args.chunk_tokens}"
        )
    return AgentConfig(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        mfu=args.mfu,
        kv_tokens=args.kv_tokens,
        served_model_name=args.served_model_name,
        block_bytes=args.block_bytes,
        role=args.role,
        admission=AdmissionConfig(
            args.admission,
            min_prefix_tokens=args.min_prefix_tokens,
            protected_fraction=args.protected_fraction,
            ghost_block_tokens=args.block_bytes // 4,
        ),
        scheduler=SchedulerConfig(
            chunk_tokens=args.chunk_tokens,
            max_running=args.max_running,
            order=args.schedule,
            max_waiting=args.max_waiting or 4 * args.max_running,
        ),
        seed=args.seed,
        worker_id=args.worker_id or urlsplit(advertise_url(args)).netloc,
        rope_scaling=args.rope_scaling,
        page_size=args.page_size,
        disable_radix_cache=args.disable_radix_cache,
        dram=dram,
        kv_link=args.kv_link,
        otlp_traces_endpoint=args.otlp_traces_endpoint or "",
        # an unsigned tenant header is safe only where nothing but the router reaches us
        trust_unsigned_tenant=is_loopback(args.host),
    )


async def serve(
    cfg: AgentConfig,
    host: str,
    port: int,
    routers: list[str],
    advertise_url: str,
    bus: str | None = None,
    bus_prefix: str = "radixfleet",
    bus_snapshot_interval_s: float = 30.0,
    bus_credentials: BusCredentials | None = None,
) -> None:
    app = create_app(
        cfg,
        routers=routers,
        advertise_url=advertise_url,
        bus=bus,
        bus_prefix=bus_prefix,
        bus_snapshot_interval_s=bus_snapshot_interval_s,
        bus_credentials=bus_credentials,
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    server = None
    try:
        # aiohttp's TCPSite, but malformed HTTP gets a JSON 4xx and no traceback
        server = await http_errors.listen(runner, host, port, access_log=None)
        from radixfleet_tools.agent.server import AGENT_KEY

        print(
            f"radixfleet agent {cfg.worker_id}: {cfg.name} on {cfg.tp}x{cfg.gpu}, "
            f"KV pool {app[AGENT_KEY].capacity:,} tokens, listening on http://{host}:{port}",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()


class _QuietGrpcProbe(logging.Filter):
    """SGLang's router probes each worker with an HTTP/2 preface (gRPC detection);
    aiohttp logs the refused preface as an error with a traceback. It is expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.server").addFilter(_QuietGrpcProbe())
    cfg = build_config(args)
    if args.bus is not None:
        check_url(args.bus, "--bus")  # exit 2 if bad
        check_name(args.bus_prefix, "--bus-prefix")
        if not args.bus_snapshot_interval > 0:
            raise ConfigError("--bus-snapshot-interval", "expected a number > 0")
        # a tokenless bus off loopback, a missing secret, a CA that does not load:
        # one line and exit 2 now, not a traceback from the running agent
        check_exposure(args.bus, os.environ.get("RADIXFLEET_AGENT_TOKEN", ""), "--bus")
        bus_credentials(args).connect_options(args.bus, agent_flag)
    elif any(getattr(args, f"bus_{n}") for n in _BUS_CREDENTIAL_FLAGS):
        raise ConfigError("--bus", "the --bus-* credential flags need --bus NATS_URL")
    advertise = advertise_url(args)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(
            serve(
                cfg,
                args.host,
                args.port,
                args.router,
                advertise,
                args.bus,
                args.bus_prefix,
                args.bus_snapshot_interval,
                bus_credentials(args),
            )
        )
    except OSError as exc:
        print(f"radixfleet agent: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    return 0
