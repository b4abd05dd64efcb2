"""``radixfleet router``: run the cache-aware router.

    radixfleet router --config FILE [--host H] [--port P] [--admin-host H] [--admin-port P]
                      [--worker-header] [--match-header]
    radixfleet router --worker URL [--worker URL ...] [--policy NAME]
                      [--policy-param NAME=VALUE ...] [--port P] [--host H] [--admin-port P]
                      [--worker-header] [--match-header]

A ``--worker`` is a base URL, ``KIND=URL`` (``vllm=http://10.0.0.5:8000``), or
comma-separated ``key=value`` settings of a YAML worker entry::

    --worker url=http://10.0.0.5:8000,kind=vllm,tokenizer=/models/llama,events=tcp://10.0.0.5:5557

(keys: url, id, kind, model, tokenizer, chat_template, block_size, kv_capacity_tokens,
events, replay_endpoint, events_mode, weight). ``--policy-param NAME=VALUE`` sets one of the
policy's parameters (``policy.params`` of the YAML; the value is read as YAML:
``footprint_room=0``, ``replicate=false``).

The quick start without a file builds the same validated ``Config`` (errors name
the field: ``workers[0].url: ...``). ``--host``/``--port`` (the data port) and
``--admin-host``/``--admin-port`` (the admin listener: admin API, ``/metrics``)
override the file and keep overriding it across reloads, as ``--worker-header`` does
``response_headers.worker_id: true`` and ``--match-header``
``response_headers.match_tokens: true``. Signals: SIGTERM/SIGINT stop accepting, let
in-flight requests finish (``limits.shutdown_timeout_s``) and exit 0; SIGHUP
reloads the file. Uses uvloop when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import yaml

from radixfleet.config import MISSING, Config, config_warnings, load_config, parse_config, with_overrides
from radixfleet.index.prefix_index import tune_gc
from radixfleet.wire.cli_args import LOG_LEVELS, log_level
from radixfleet.wire.errors import ConfigError

log = logging.getLogger("radixfleet.router")


def configure(parser: argparse.ArgumentParser, *, admin: bool = True) -> None:
    """The router's flags; ``admin``: with the admin listener's (``radixfleet gateway``
    serves its router's whole API on ``listen``: none)."""
    parser.add_argument("--config", metavar="FILE", help="router YAML file (deploy/README.md)")
    parser.add_argument(
        "--worker",
        metavar="[KIND=]URL|k=v,...",
        action="append",
        default=[],
        help="a worker: URL, KIND=URL (agent, vllm, sglang, openai) or "
        "url=..,kind=..,tokenizer=..,events=tcp://.. (repeatable; "
        "quick start without --config)",
    )
    from radixfleet.policies.registry import policy_names

    parser.add_argument(
        "--policy",
        metavar="NAME",
        default=MISSING,
        help=f"routing policy (quick start; default prefix_load): one of {', '.join(policy_names())}",
    )
    parser.add_argument(
        "-P",
        "--policy-param",
        metavar="[POLICY.]NAME=VALUE",
        action="append",
        default=[],
        help="a parameter of the policy (quick start; repeatable; "
        "the value is read as YAML), e.g. -P footprint_room=0 or "
        "-P prefix_load.footprint_room=0",
    )
    parser.add_argument(
        "--worker-header",
        action="store_true",
        help="answers name the worker that served them in an x-radixfleet-worker header "
        "(response_headers.worker_id: true; off by default, for tests and load generators)",
    )
    parser.add_argument(
        "--match-header",
        action="store_true",
        help="answers carry x-radixfleet-available-tokens and x-radixfleet-predicted-tokens "
        "(response_headers.match_tokens: true; off by default, for load generators)",
    )
    parser.add_argument("--host", default=MISSING, help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=MISSING, help="listen port (default 8000)")
    parser.add_argument(
        "--log-level", type=log_level, default="INFO", help=f"{', '.join(LOG_LEVELS)} (any case)"
    )
    if not admin:
        return
    parser.add_argument(
        "--admin-host",
        default=MISSING,
        help="the admin listener's address: admin API, /metrics (admin.host; default 127.0.0.1)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=MISSING,
        help="the admin listener's port (admin.port; default 8001; 0: a free port)",
    )


_INT_KEYS = ("block_size", "kv_capacity_tokens")
_EVENT_KEYS = {
    "events": "endpoint",
    "replay_endpoint": "replay_endpoint",
    "events_mode": "mode",
    "topic": "topic",
}
_PLAIN_KEYS = ("url", "id", "kind", "model", "tokenizer", "chat_template")


def worker_entry(text: str, where: str) -> dict:
    """A YAML worker entry from one ``--worker`` value (module docstring)."""
    if "," not in text and not text.startswith("url="):
        kind, sep, url = text.partition("=")
        if sep and "://" not in kind:
            return {"url": url, "kind": kind}
        return {"url": text}
    entry: dict = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or not k:
            raise ConfigError(where, f"expected key=value, got {item!r}")
        if k in _INT_KEYS:
            try:
                entry[k] = int(v)
            except ValueError:
                raise ConfigError(f"{where}.{k}", f"expected an integer, got {v!r}") from None
        elif k == "weight":
            try:
                entry[k] = float(v)
            except ValueError:
                raise ConfigError(f"{where}.{k}", f"expected a number, got {v!r}") from None
        elif k in _EVENT_KEYS:
            entry.setdefault("events", {})[_EVENT_KEYS[k]] = v
        elif k in _PLAIN_KEYS:
            entry[k] = v
        else:
            valid = ", ".join(sorted((*_PLAIN_KEYS, *_INT_KEYS, *_EVENT_KEYS, "weight")))
            raise ConfigError(f"{where}.{k}", f"unknown key; valid: {valid}")
    return entry


def policy_params(pairs: list[str], where: str = "--policy-param", policy: str | None = None) -> dict:
    """``["NAME=VALUE" | "POLICY.NAME=VALUE", ...]`` -> ``{NAME: value}``, each value
    read as YAML (a plain string where it is not YAML). ``POLICY.`` (the syntax of
    ``simulate -P``) must name ``policy`` when that is known. Raises ``ConfigError``
    naming ``where``; the names and values are validated with the policy
    (``radixfleet.policies.registry``)."""
    out: dict = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        pol, dot, rest = name.rpartition(".")
        if dot:
            if policy is not None and pol != policy:
                raise ConfigError(where, f"{pair!r} is for policy {pol!r}, but the policy is {policy!r}")
            name = rest
        if not sep or not name:
            raise ConfigError(where, f"{pair!r} must be [POLICY.]NAME=VALUE")
        try:
            out[name] = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            out[name] = value
    return out


def build_config(args: argparse.Namespace) -> tuple[Config, dict]:
    """The validated config and the overrides to reapply on reload. Raises ConfigError."""
    overrides = {}
    if args.host is not MISSING:
        overrides["listen__host"] = args.host
    if args.port is not MISSING:
        if not 0 <= args.port <= 65535:
            raise ConfigError("--port", f"expected an integer in [0, 65535], got {args.port}")
        overrides["listen__port"] = args.port
    admin_host, admin_port = getattr(args, "admin_host", MISSING), getattr(args, "admin_port", MISSING)
    if admin_host is not MISSING:
        overrides["admin__host"] = admin_host
    if admin_port is not MISSING:
        if not 0 <= admin_port <= 65535:
            raise ConfigError("--admin-port", f"expected an integer in [0, 65535], got {admin_port}")
        overrides["admin__port"] = admin_port
    if args.worker_header:
        overrides["response_headers__worker_id"] = True
    if args.match_header:
        overrides["response_headers__match_tokens"] = True
    if args.config:
        if args.worker or args.policy is not MISSING or args.policy_param:
            raise ConfigError(
                "",
                "--worker, --policy and --policy-param are for the quick "
                "start without --config; list workers and the policy in the file",
            )
        cfg = load_config(args.config)
    else:
        raw: dict = {"workers": [worker_entry(w, f"--worker[{i}]") for i, w in enumerate(args.worker)]}
        if args.policy is not MISSING:
            raw["policy"] = {"name": args.policy}
        if args.policy_param:
            raw.setdefault("policy", {})["params"] = policy_params(
                args.policy_param, policy=args.policy if args.policy is not MISSING else "prefix_load"
            )
        cfg = parse_config(raw)
    return with_overrides(cfg, **overrides), overrides


async def serve(cfg: Config, overrides: dict, *, ready=None) -> int:
    """Runs the router until SIGTERM/SIGINT. ``ready(server)`` is called once listening."""
    from radixfleet.server.app import Router, RouterServer

    router = Router(cfg, overrides=overrides)
    server = RouterServer(router)
    await server.start()
    if ready is not None:
        ready(server)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reloads: set[asyncio.Task] = set()

    def on_hup() -> None:
        if router.cfg.path:
            t = loop.create_task(router.reload())
            reloads.add(t)
            t.add_done_callback(reloads.discard)
        else:
            log.warning("SIGHUP ignored: started without --config")

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    try:
        await stop.wait()
        log.info("shutting down: finishing in-flight requests (up to %.0fs)", cfg.limits.shutdown_timeout_s)
    finally:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(s)
        await server.aclose()
    return 0


def run(args: argparse.Namespace) -> int:
    cfg, overrides = build_config(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in config_warnings(cfg):
        log.warning("%s", warning)
    tune_gc()  # the index's millions of nodes: the collector would rescan them (its docstring)

    def ready(server) -> None:
        print(
            f"radixfleet router: listening on http://{server.host}:{server.port} ({cfg.summary()}); "
            f"admin on http://{server.admin_host}:{server.admin_port}",
            flush=True,
        )

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(serve(cfg, overrides, ready=ready))
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(serve(cfg, overrides, ready=ready))
    uvloop.install()  # pragma: no cover
    return asyncio.run(serve(cfg, overrides, ready=ready))
