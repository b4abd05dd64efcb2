"""``workers:``: one entry per static worker (``WorkerSpec``: where it is, what it
is, its own engine settings), and the worker URL rules every other way in
(registration, ``POST /admin/workers``, the bus, discovery) shares
(``parse_worker_url``: canonical, plain http, no credentials, no query).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from radixfleet.config.engines import ENGINE_FIELDS, EngineSettings, check_engine_fields
from radixfleet.config.kinds import KIND_DOC, ROLE_DOC, KindOrAuto, Role
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.identifiers import MAX_URL_CHARS, id_problem, worker_host
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class WorkerSpec(EngineSettings):
    """One worker entry: where the worker is and what it is, plus its own engine
    settings (``EngineSettings``; those it leaves unset come from ``models:``)."""

    url: str = _opt("", "base URL of the worker, http://host:port")
    id: str = _opt("", "worker id (default: host:port of url)")
    weight: float = _opt(1.0, "relative capacity weight", lo=0.01, hi=100.0)
    prefill_tokens_per_s: float = _opt(
        10_000.0, "prefill throughput assumed until measured or reported", lo=1.0, hi=1e12
    )
    kind: KindOrAuto = _opt("auto", KIND_DOC)
    model: str = _opt("", "the model it serves (default: from its /v1/models)")
    role: Role = _opt("both", ROLE_DOC)
    bootstrap_port: int = _opt(
        8998,
        "an SGLang prefill worker's --disaggregation-bootstrap-port (sent to both legs)",
        lo=1,
        hi=65535,
    )

    @document_check
    def _check(self) -> None:
        """The url canonical and the id defaulted (set here: both feed the checks after)."""
        if not self.url:
            raise ConfigError("url", "required: the worker's base URL")
        object.__setattr__(self, "url", parse_worker_url(self.url, "url"))
        check_engine_fields(self, "")
        object.__setattr__(self, "id", self.id or default_worker_id(self.url))
        problem = id_problem(self.id)
        if problem:
            raise ConfigError("id", problem)


def unique_workers(workers: tuple[WorkerSpec, ...]) -> None:
    ids: dict[str, int] = {}
    urls: dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.id in ids:
            raise ConfigError(f"[{i}].id", f"duplicate worker id {w.id!r} (also workers[{ids[w.id]}])")
        if w.url in urls:
            raise ConfigError(f"[{i}].url", f"duplicate worker url {w.url!r} (also workers[{urls[w.url]}])")
        ids[w.id] = urls[w.url] = i


def parse_worker_url(url: str, path: str) -> str:
    """Validates a worker base URL; returns it canonical (host lower case, numeric IPv4
    forms as a dotted quad: ``radixfleet.wire.identifiers.worker_host``) without a trailing
    slash."""
    if len(url) > MAX_URL_CHARS:
        raise ConfigError(path, f"a worker URL has at most {MAX_URL_CHARS} characters, got {len(url)}")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        # the URL's host:port goes into every upstream request's Host header
        raise ConfigError(
            path,
            f"a worker URL is printable ASCII without spaces (punycode "
            f"for international names), got {url[:200]!r}",
        )
    try:
        parts = urlsplit(url)
        parts.hostname  # noqa: B018 - parsed lazily; may raise too
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ConfigError(path, f"invalid URL {url[:200]!r}: {exc}") from None
    if parts.scheme == "https":
        raise ConfigError(
            path,
            f"https workers are not supported (the data plane speaks plain "
            f"HTTP/1.1 on a private network), got {url!r}",
        )
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(path, f"expected an http:// URL with a host, got {url!r}")
    try:
        parts.port  # noqa: B018 (reading it validates the port)
    except ValueError:
        raise ConfigError(path, f"invalid port in {url!r}") from None
    if parts.query or parts.fragment:
        raise ConfigError(path, f"a worker URL takes no query or fragment, got {url!r}")
    if "@" in parts.netloc:
        # credentials would travel in every health check and be shown by /admin/workers
        raise ConfigError(
            path, "a worker URL takes no user:password@ part (the router authenticates to no worker)"
        )
    host, problem = worker_host(parts.hostname)
    if problem:
        raise ConfigError(path, problem)
    port = f":{parts.port}" if parts.port is not None else ""
    return f"http://{host}{port}{parts.path}".rstrip("/")


def selector_template(sel: Any) -> WorkerSpec:
    """The worker entry a selector (or DNS service) gives each worker it finds (url
    and id are the endpoint's)."""
    return WorkerSpec(model=sel.model, role=sel.role, **{name: getattr(sel, name) for name in ENGINE_FIELDS})


def default_worker_id(url: str) -> str:
    return urlsplit(url).netloc


def resolve_engine(
    spec: WorkerSpec, models: Mapping[str, EngineSettings], served: tuple[str, ...] = ()
) -> WorkerSpec:
    """``spec`` with every engine setting it leaves at its default taken from the
    ``models:`` entry of its model: ``spec.model``, else the first of ``served``
    (what the worker said it serves) that has an entry. Sections (events, metrics)
    are merged key by key. The worker's own setting wins where it differs from the
    default; a worker with no entry is returned as it is. O(fields)."""
    names = (spec.model,) if spec.model else served
    entry = next((models[n] for n in names if n in models), None)
    if entry is None:
        return spec
    return dataclasses.replace(
        spec, **{name: _merged(getattr(spec, name), getattr(entry, name)) for name in ENGINE_FIELDS}
    )


def _merged(own: Any, entry: Any) -> Any:
    if dataclasses.is_dataclass(own) and not isinstance(own, type):
        default = type(own)()
        return dataclasses.replace(
            own,
            **{
                f.name: _merged_scalar(getattr(own, f.name), getattr(entry, f.name), getattr(default, f.name))
                for f in dataclasses.fields(own)
            },
        )
    return _merged_scalar(own, entry, type(own)())


def _merged_scalar(own: Any, entry: Any, default: Any) -> Any:
    return entry if own == default else own
