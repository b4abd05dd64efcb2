"""Engine settings: what follows a worker's model rather than the worker
(``EngineSettings``: ``models.<name>``, a discovery selector, a worker entry), its
KV events (``EventsSpec``) and load scrape (``EngineScrapeSpec``), and where an
engine's tokenizer comes from when none is named (``tokenizers:``,
``TokenizersConfig``).

Rules: an events endpoint is for vllm/sglang only, and one shared by many workers
names no host (``check_engine_fields``); which side of an endpoint binds
(``check_event_sides``); a tokenizer loads without a download
(``check_tokenizer_source``). Across sections (``radixfleet.config.document``): an
events endpoint, block size or chat template needs a tokenizer from somewhere.
``radixfleet.config.workers.resolve_engine`` fills a worker's unset engine settings
from its model's entry; ``radixfleet.config.runtime`` checks binds and loads tokenizers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.extras import require
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import section as _section
from radixfleet.wire.settings import setting as _opt


@settings
class TokenizersConfig:
    """Where a vLLM or SGLang worker's tokenizer comes from when neither its entry
    nor ``models:`` names one (``radixfleet.engines.tokenizer_source``)."""

    discover: bool = _opt(
        True,
        "key a vLLM/SGLang worker with no tokenizer set with the one its engine names "
        "(vLLM's GET /v1/models root, SGLang's GET /get_model_info tokenizer_path), when "
        "the router can read it: a folder here (the same host, a shared volume) or a repo "
        "in the local Hugging Face cache; checked once against the engine's /tokenize",
    )
    download: bool = _opt(
        False,
        "download such a tokenizer from the Hugging Face hub when the engine names a "
        "repo that is not in the local cache (needs the hub reachable; off: nothing is "
        "downloaded)",
    )
    engine_tokenize: bool = _opt(
        True,
        "key a vLLM/SGLang worker whose tokenizer cannot be loaded here through its "
        "engine's POST /tokenize: one round trip before each request's pick (a few ms, "
        "radixfleet.engines.engine_keys), identical requests cached; off: routing bytes",
    )
    engine_timeout_s: float = _opt(
        0.5,
        "the longest a request waits for its engine's /tokenize; past it, that "
        "request routes by load (its keys unknown)",
        lo=0,
        lo_open=True,
        hi=10.0,
    )


@settings
class EventsSpec:
    """An engine's KV-cache events: its endpoint as given to the engine, and which side
    binds (``check_event_sides``)."""

    endpoint: str = _opt(
        "",
        "the engine's own KV-events endpoint, as given to it "
        "(vLLM --kv-events-config endpoint: tcp://*:5557, tcp://HOST:PORT "
        "or ipc://PATH); empty: a vLLM worker's are asked of the server "
        "(GET /kv_event_sources, every data-parallel rank), others send none",
    )
    mode: Literal["auto", "bind", "connect", "off"] = _opt(
        "auto",
        "auto follows vLLM's rule: the engine binds a wildcard or ipc:// "
        "endpoint (the router connects, to the worker's host for a wildcard) and "
        "connects to a concrete tcp://HOST:PORT (the router binds it); bind or "
        "connect force the router's side; off: follow none (approximate mode)",
    )
    replay_endpoint: str = _opt(
        "", "the engine's replay endpoint (missed batches by sequence number); empty: none"
    )
    topic: str = _opt("kv-events", "ZMQ topic the engine publishes under")


@settings
class EngineScrapeSpec:
    """Scraping an engine's Prometheus page for its load."""

    path: str = _opt("/metrics", "Prometheus page of the engine; empty: do not scrape")
    interval_s: float = _opt(1.0, "seconds between scrapes", lo=0.05)
    timeout_s: float = _opt(1.0, "scrape timeout", lo=0, lo_open=True)


@settings
class EngineSettings:
    """The engine settings that follow a worker's model rather than the worker: one
    ``models.<served name>`` entry, or what a discovery selector gives every worker it
    finds. A worker entry has them too; ``resolve_engine`` fills a worker's unset
    ones from here."""

    tokenizer: str = _opt(
        "",
        "the engine's tokenizer and chat template: a local folder or "
        "a repo id in the local Hugging Face cache (exact token keys)",
    )
    chat_template: str = _opt(
        "",
        "the engine's --chat-template (a file or the template), replacing the tokenizer's; needs a tokenizer",
    )
    block_size: int = _opt(0, "the engine's KV block size in tokens (0: from its metrics or events)", lo=0)
    kv_capacity_tokens: int = _opt(
        0, "the engine's KV capacity in tokens for the approximate index (0: from its metrics)", lo=0
    )
    priority_field: bool = _opt(
        False,
        "send each request's priority class as the body 'priority', on every endpoint, in the "
        "engine's order (vLLM: critical 0, standard 1, sheddable 2, lower served first; SGLang: "
        "2, 1, 0, higher first), replacing the client's: for a vLLM started with --scheduling-policy "
        "priority (an fcfs one may refuse a non-zero value) or an SGLang with "
        "--enable-priority-scheduling; off, a client's 'priority' is dropped. An agent's own "
        "--schedule, announced at registration, decides for it",
    )
    events: EventsSpec = _section(
        EventsSpec,
        "the engine's KV-cache events (for many workers: a wildcard tcp://*:PORT, each engine binds it)",
    )
    metrics: EngineScrapeSpec = _section(EngineScrapeSpec, "scraping the engine's load")

    @document_check
    def _check(self) -> None:
        check_engine_fields(self, "", per_worker=False)


#: the fields a ``models:`` entry or a selector may set for a worker
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings))


def check_events_endpoint(endpoint: str, path: str) -> str:
    """Validates a ZMQ endpoint: ``tcp://HOST:PORT`` (HOST may be ``*``) or ``ipc://PATH``."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ConfigError(path, f"expected ipc://PATH, got {endpoint!r}")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return endpoint
    raise ConfigError(path, f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")


def check_tokenizer_source(source: str, path: str) -> None:
    """A tokenizer must be loadable without a download: a folder holding one, or a
    repo id already in the local Hugging Face cache. Raises ``ConfigError``."""
    folder = os.path.expanduser(source)
    if os.path.isdir(folder):
        try:
            names = set(os.listdir(folder))
        except OSError as exc:
            raise ConfigError(
                path, f"tokenizer folder {source!r} is not readable: {exc.strerror or exc}"
            ) from None
        if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
            raise ConfigError(
                path, f"{source!r} holds no tokenizer (tokenizer.json or tokenizer_config.json)"
            )
        return
    if os.path.exists(folder):
        raise ConfigError(path, f"tokenizer {source!r} is not a folder")
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ConfigError(path, f"tokenizer folder {source!r} does not exist")
    try_to_load_from_cache = require(
        "huggingface_hub", "engines", "a tokenizer from the Hugging Face cache"
    ).try_to_load_from_cache
    for name in ("tokenizer_config.json", "tokenizer.json"):
        try:
            hit = try_to_load_from_cache(source, name)
        except ValueError:  # not a valid repo id
            hit = None
        if isinstance(hit, str):
            return
    raise ConfigError(
        path,
        f"{source!r} is neither a folder nor a repo in the local Hugging "
        "Face cache (nothing is downloaded at run time)",
    )


def check_engine_fields(spec: Any, path: str, *, per_worker: bool = True) -> None:
    """Cross-field rules of engine settings: a worker entry's (``per_worker``), or a
    ``models:`` entry's or a selector's (``EngineSettings``: an events endpoint there
    must name no one host). Whether a tokenizer comes with an events endpoint is
    checked against ``models:`` once both are parsed (``radixfleet.config.document``).
    Raises ``ConfigError``."""
    ev = spec.events
    kind = getattr(spec, "kind", "")
    if ev.endpoint and ev.mode == "off":
        raise ConfigError(
            f"{path}.events.mode",
            "off follows no events; remove events.endpoint or choose auto, bind or connect",
        )
    if ev.endpoint:
        if kind == "agent":
            raise ConfigError(
                f"{path}.events.endpoint",
                "agents push their events to the "
                "router over HTTP; events.endpoint is for vllm/sglang engines",
            )
        check_events_endpoint(ev.endpoint, f"{path}.events.endpoint")
        check_event_sides(ev.endpoint, ev.mode, f"{path}.events")
        if not per_worker and concrete_host(ev.endpoint):
            raise ConfigError(
                f"{path}.events.endpoint",
                f"{ev.endpoint!r} names one host, "
                "but these settings apply to many workers: write the port as "
                "the engines are given it, tcp://*:PORT (each engine binds it; "
                "the router connects to each worker's host), or list the "
                "worker under workers with its own endpoint",
            )
    if ev.replay_endpoint:
        if not ev.endpoint:
            raise ConfigError(f"{path}.events.replay_endpoint", "needs events.endpoint")
        check_events_endpoint(ev.replay_endpoint, f"{path}.events.replay_endpoint")
    if spec.tokenizer:
        if kind == "agent":
            raise ConfigError(
                f"{path}.tokenizer",
                "agents are keyed on routing bytes "
                "(keys.block_bytes); a tokenizer is for vllm/sglang engines",
            )
        check_tokenizer_source(spec.tokenizer, f"{path}.tokenizer")


def concrete_host(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and not endpoint.startswith("tcp://*:")


def check_event_sides(endpoint: str, mode: str, path: str) -> None:
    """Refuses an events endpoint on which both sides would bind or both connect.

    ``endpoint`` is the engine's own, as given to it; vLLM's publisher binds a
    wildcard ``tcp://*:PORT`` or an ``ipc://`` path and connects to a concrete
    ``tcp://HOST:PORT`` (then the router must bind it). ``mode`` forces the router's
    side. Raises ``ConfigError`` saying which side binds and what to write."""
    wildcard = not concrete_host(endpoint)
    if mode == "bind" and wildcard:
        raise ConfigError(
            f"{path}.mode",
            f"the engine binds {endpoint} itself (a wildcard "
            "or ipc:// endpoint), so the router must connect: remove "
            "mode: bind (auto connects)",
        )
    if mode == "connect" and not wildcard:
        raise ConfigError(
            f"{path}.mode",
            f"given {endpoint}, a concrete host, the engine "
            "connects to it, so the router must bind it: remove mode: connect "
            "(auto binds), or give the engine tcp://*:PORT and write that here",
        )
