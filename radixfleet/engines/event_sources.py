"""Where a vLLM server publishes its KV events, asked of the server itself.

vLLM 0.32 answers ``GET /kv_event_sources`` with the KV-events config of each ready
engine core, keyed by data-parallel rank (``EngineCoreClient.get_kv_event_sources``)::

    {"0": {"enable_kv_cache_events": true, "publisher": "zmq",
           "endpoint": "tcp://*:19901", "replay_endpoint": "tcp://*:19911",
           "topic": "kv-events", ...},
     "1": {..., "endpoint": "tcp://*:19902", "replay_endpoint": "tcp://*:19912"}}

Each rank's endpoints are already offset by its rank (vLLM's
``ZmqEventPublisher.offset_endpoint_port``); they are the strings the publisher was
given, so the router applies vLLM's bind/connect rule to them
(``radixfleet.engines.zmq_events.subscriber_endpoint``): a wildcard ``tcp://*:P`` or an
``ipc://`` endpoint is bound by the engine (the router connects, to the worker's
host at P), a concrete ``tcp://HOST:P`` is connected to by the engine (the router
binds it). A worker's configured ``events:`` wins over what the server says.

``fetch_event_sources`` returns the sources, or a ``SourcesProblem`` with one of a
small fixed set of causes (the metric label), never raises for what a server sends:

=============  ==============================================  =====================
cause          the server                                       the link
=============  ==============================================  =====================
unreachable    no answer, or a 5xx (starting, overloaded)       asks again (backoff)
missing        404: a vLLM older than 0.32 (or not vLLM)        approximate mode
empty          ``{}``: KV events are not enabled                approximate mode
disabled       ranks listed, none with ``publisher: zmq`` and   approximate mode
               ``enable_kv_cache_events``
malformed      not a JSON object of rank -> config with an      approximate mode
               endpoint the router can use
not_allowed    an endpoint off the worker's host or not tcp://  approximate mode
               (``sources_problem``, asked by the link)
=============  ==============================================  =====================

The endpoints come from the worker, so they must not aim the router anywhere
else (``endpoint_problem``): every endpoint and replay endpoint is ``tcp://``, on
the worker's own host — a wildcard (the engine binds it; the router connects to the
worker's host) or the worker URL's host itself — or at an address inside
``registration.allow``. An ``ipc://`` or ``inproc://`` one names a socket on the
router's own host, and a concrete address elsewhere is one the router would
connect to (a replay endpoint) or bind (a publisher that connects): one worker once
had the router dialling an arbitrary TCP address and a unix socket 8.5 times a
second. Such an answer is ``not_allowed``: one log line, the approximate mode.

Only this module knows the answer's shape; no I/O beyond the one GET.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
from dataclasses import dataclass

import aiohttp

from radixfleet.common import jsonbody
from radixfleet.wire.errors import MalformedRequest
from radixfleet.wire.identifiers import ip_of

PATH = "/kv_event_sources"
#: more ranks than this is not a server's answer (vLLM's largest DP deployments are
#: a few hundred ranks)
MAX_RANKS = 1024
MAX_BODY_BYTES = 1 << 20
_SCHEMES = ("tcp://", "ipc://", "inproc://")


class SourcesCause(str, enum.Enum):
    """Why a server's event sources cannot be used (module docstring's table)."""

    UNREACHABLE = "unreachable"
    MISSING = "missing"
    EMPTY = "empty"
    DISABLED = "disabled"
    MALFORMED = "malformed"
    NOT_ALLOWED = "not_allowed"  # an endpoint off the worker's host, or not tcp://


@dataclass(frozen=True, slots=True)
class EventSource:
    """One data-parallel rank's KV-event publisher, as the engine was configured."""

    rank: int  # the data-parallel rank (0 for a server without data parallelism)
    endpoint: str  # the publisher's endpoint string (vLLM's rule decides who binds)
    topic: str
    replay_endpoint: str | None  # the rank's replay ROUTER (the engine binds it), or None


@dataclass(frozen=True, slots=True)
class SourcesProblem:
    cause: SourcesCause
    detail: str  # one short line for the log


def parse_event_sources(status: int, body: bytes) -> tuple[EventSource, ...] | SourcesProblem:
    """The usable sources of one ``/kv_event_sources`` answer, in rank order, or why
    there are none. Ranks must be 0..N-1, each one exactly once."""
    if status == 404:
        return SourcesProblem(
            SourcesCause.MISSING, "GET /kv_event_sources answered 404 (vLLM before 0.32 does not serve it)"
        )
    if status >= 500:
        return SourcesProblem(SourcesCause.UNREACHABLE, f"GET /kv_event_sources answered {status}")
    if status != 200:
        return SourcesProblem(SourcesCause.MALFORMED, f"GET /kv_event_sources answered {status}")
    try:
        obj = jsonbody.loads(body, max_depth=8, what="the answer")  # a config is 2 deep
    except MalformedRequest as exc:
        return SourcesProblem(SourcesCause.MALFORMED, str(exc)[:200])
    if not isinstance(obj, dict):
        return SourcesProblem(
            SourcesCause.MALFORMED, f"the answer is a JSON {type(obj).__name__}, want an object"
        )
    if not obj:
        return SourcesProblem(
            SourcesCause.EMPTY, "no rank publishes KV events (start vLLM with --kv-events-config)"
        )
    if len(obj) > MAX_RANKS:
        return SourcesProblem(SourcesCause.MALFORMED, f"{len(obj)} ranks (at most {MAX_RANKS})")
    out: list[EventSource] = []
    for k, cfg in obj.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 6):
            return SourcesProblem(SourcesCause.MALFORMED, f"rank {k[:20]!r} is not a number")
        rank = int(k)
        if not isinstance(cfg, dict):
            return SourcesProblem(SourcesCause.MALFORMED, f"rank {rank}: not an object")
        if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher") not in (None, "zmq"):
            continue  # this rank publishes nothing a subscriber can read
        ep, topic, replay = cfg.get("endpoint"), cfg.get("topic", ""), cfg.get("replay_endpoint")
        if not isinstance(ep, str) or not ep.strip().startswith(_SCHEMES) or len(ep) > 512:
            return SourcesProblem(
                SourcesCause.MALFORMED,
                f"rank {rank}: endpoint {str(ep)[:60]!r} is not a tcp://, ipc:// or inproc:// address",
            )
        if replay is not None and (
            not isinstance(replay, str) or len(replay) > 512 or not replay.strip().startswith(_SCHEMES)
        ):
            return SourcesProblem(
                SourcesCause.MALFORMED,
                f"rank {rank}: replay_endpoint {str(replay)[:60]!r} is not "
                "a tcp://, ipc:// or inproc:// address",
            )
        if topic is None:
            topic = ""
        if not isinstance(topic, str) or len(topic) > 256:
            return SourcesProblem(SourcesCause.MALFORMED, f"rank {rank}: topic is not a string")
        out.append(EventSource(rank, ep.strip(), topic, replay.strip() if replay else None))
    if not out:
        return SourcesProblem(SourcesCause.DISABLED, f"{len(obj)} rank(s) listed, none publishing over ZMQ")
    out.sort(key=lambda s: s.rank)
    if len(out) != len(obj) or [s.rank for s in out] != list(range(len(out))):
        return SourcesProblem(
            SourcesCause.MALFORMED,
            "ranks are not 0..N-1, each publishing: " + ", ".join(str(s.rank) for s in out[:8]),
        )
    return tuple(out)


#: the hosts of a tcp:// endpoint the engine binds on every interface
_WILDCARDS = ("*", "[*]", "[::]", "::")


def endpoint_problem(
    endpoint: str, worker_host: str | None, allowed: tuple[ipaddress._BaseNetwork, ...] = ()
) -> str | None:
    """Why the router must not attach to ``endpoint``, named by the server at
    ``worker_host`` (its URL's host), or None (module docstring): ``tcp://`` with a
    wildcard host, the worker's own host, or an address inside ``allowed``."""
    ep = endpoint.strip()
    if not ep.startswith("tcp://"):
        return (
            f"endpoint {ep[:60]!r} is not tcp:// (an ipc:// or inproc:// socket would be "
            "one on the router's own host)"
        )
    host, sep, port = ep[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        return f"endpoint {ep[:60]!r} is not tcp://HOST:PORT"
    if host in _WILDCARDS:
        return None
    a = ip_of(host)
    w = ip_of(worker_host or "")
    if a is not None and w is not None and a == w:
        return None
    if a is None and worker_host and host.lower() == worker_host.lower():
        return None
    if a is not None and any(a.version == n.version and a in n for n in allowed):
        return None
    return f"endpoint {ep[:60]!r} is not on the worker's host {worker_host} (nor inside registration.allow)"


def sources_problem(
    sources: tuple[EventSource, ...], worker_host: str | None, allowed: tuple = ()
) -> SourcesProblem | None:
    """The first endpoint of ``sources`` the router must not attach to, as a
    ``not_allowed`` problem, or None (``endpoint_problem``)."""
    for s in sources:
        for ep in (s.endpoint, s.replay_endpoint):
            if ep is None:
                continue
            problem = endpoint_problem(ep, worker_host, allowed)
            if problem:
                return SourcesProblem(SourcesCause.NOT_ALLOWED, f"rank {s.rank}: {problem}")
    return None


async def fetch_event_sources(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0
) -> tuple[EventSource, ...] | SourcesProblem:
    """``GET url/kv_event_sources``, parsed (``parse_event_sources``); a server that
    does not answer in ``timeout_s`` is ``unreachable``."""
    try:
        async with session.get(url + PATH, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.content.read(MAX_BODY_BYTES + 1)
            status = r.status
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        return SourcesProblem(SourcesCause.UNREACHABLE, f"GET /kv_event_sources failed: {type(exc).__name__}")
    if len(body) > MAX_BODY_BYTES:
        return SourcesProblem(SourcesCause.MALFORMED, f"answer over {MAX_BODY_BYTES} bytes")
    return parse_event_sources(status, body)
