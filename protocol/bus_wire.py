"""What travels on the bus (DESIGN.md contract 11): subjects and message bodies.

Every body is a JSON object with ``"v": 1`` and a ``"kind"``; anything else on our
subjects is *foreign* or *malformed* and raises ``BadMessage`` with a short cause word
(the receiver counts it per cause, logs it once, ignores it)::

    <prefix>.agent.<wtoken>      JetStream (the stream): one agent's event batches
        {"v":1, "kind":"agent", "batch": <protocol.events batch JSON>,
         "register": {"models": [...], "block_bytes": 128}}     # with snapshots only
    <prefix>.load.<wtoken>       core NATS: the agent's load, every interval (not kept:
                                 only the latest matters, and the stream stays events only)
        {"v":1, "kind":"load", "batch": <batch JSON with "events": [] and "load">}
    <prefix>.ctl.snapshot.<wtoken>  core NATS: a replica asks that agent for a snapshot
        {"v":1, "kind":"snapshot_request", "worker_id": "...", "replica": "..."}
    <prefix>.router.<replica>    core NATS: one replica's pick-time state
        {"v":1, "kind":"router", "replica": "r1", "seq": 7, "block_bytes": 128,
         "full": false,                              # true: heartbeat, every worker
         "inflight": {"w1": [requests, prompt_tokens], ...},     # absolute counts
         "hints": [["w1", age_s, [h1, h2, ...]], ...],
         "repl": [["add"|"retire", key, depth, "w1"], ...],   # hot-root replication
         "bye": false}                               # true: the replica is leaving

``wtoken`` is the worker id in hex (ids hold dots and colons, which subjects cannot).
In-flight counts travel as absolute values per worker, not as deltas, so a lost
message is healed by the next one for that worker (at the latest the heartbeat).
A hint's age is seconds since the pick on the sender, so clocks need not agree.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit

from protocol.errors import ConfigError, RequestError
from protocol.events import EventBatch, Snapshot, parse_batch

#: what a stream name, subject prefix or replica id may hold (NATS tokens: no dots,
#: spaces or wildcards)
NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def check_url(url: str, key: str = "bus.url") -> None:
    """Raises ``ConfigError`` (at ``key``) unless ``url`` is ``nats://host[:port]``."""
    parts = urlsplit(url)
    if parts.scheme not in ("nats", "tls") or not parts.hostname:
        raise ConfigError(key, f"expected nats://host:port, got {url!r}")
    try:
        parts.port
    except ValueError:
        raise ConfigError(key, f"invalid port in {url!r}") from None


def check_name(value: str, key: str) -> None:
    """Raises ``ConfigError`` (at ``key``) unless ``value`` is one NATS subject token."""
    if not NAME.match(value):
        raise ConfigError(key, f"expected letters, digits, '_' or '-', got {value!r}")


VERSION = 1
#: the JetStream header that makes a message replace every earlier one on its subject
ROLLUP_HEADER = {"Nats-Rollup": "sub"}


class BadMessage(Exception):
    """A message the bus receiver ignores; ``cause`` labels the metric."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


def worker_token(worker_id: str) -> str:
    return worker_id.encode("utf-8", "surrogateescape").hex()


class Subjects:
    """The subjects under one prefix."""

    __slots__ = ("prefix", "agents", "routers", "loads")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.agents = f"{prefix}.agent.>"  # the stream's subjects
        self.routers = f"{prefix}.router.*"
        self.loads = f"{prefix}.load.*"

    def agent(self, worker_id: str) -> str:
        return f"{self.prefix}.agent.{worker_token(worker_id)}"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}.load.{worker_token(worker_id)}"

    def snapshot_request(self, worker_id: str) -> str:
        return f"{self.prefix}.ctl.snapshot.{worker_token(worker_id)}"

    def router(self, replica: str) -> str:
        return f"{self.prefix}.router.{replica}"


def _load(data: bytes, kind: str) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise BadMessage("not_json", "body is not JSON") from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION or "kind" not in obj:
        raise BadMessage("foreign", "not a radixfleet bus message (no v=1/kind)")
    if obj["kind"] != kind:
        raise BadMessage("wrong_kind", f"kind {obj['kind']!r} where {kind!r} belongs")
    return obj


# ------------------------------------------------------------------ agents


class AgentMessage:
    """One agent batch from the stream; ``register`` is set on snapshots."""

    __slots__ = ("batch", "models", "block_bytes", "register")

    def __init__(self, batch: EventBatch, register: bool, models: tuple[str, ...] = (),
                 block_bytes: int | None = None) -> None:
        self.batch = batch
        self.register = register
        self.models = models
        self.block_bytes = block_bytes


def build_agent(batch: EventBatch, models: list[str], block_bytes: int | None) -> bytes:
    obj: dict[str, Any] = {"v": VERSION, "kind": "agent", "batch": batch.to_json()}
    if batch.events and isinstance(batch.events[0], Snapshot):
        obj["register"] = {"models": list(models), "block_bytes": block_bytes}
    return json.dumps(obj, separators=(",", ":")).encode()


def is_snapshot(batch: EventBatch) -> bool:
    return bool(batch.events) and isinstance(batch.events[0], Snapshot)


def parse_agent(data: bytes, subject_token: str) -> AgentMessage:
    obj = _load(data, "agent")
    batch = _batch(obj, subject_token, load=False)
    reg = obj.get("register")
    if reg is None:
        return AgentMessage(batch, False)
    if not isinstance(reg, dict):
        raise BadMessage("bad_register", "'register' must be an object")
    models = reg.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise BadMessage("bad_register", "'register.models' must be a list of strings")
    bb = reg.get("block_bytes")
    if bb is not None and (type(bb) is not int or bb <= 0):
        raise BadMessage("bad_register", "'register.block_bytes' must be a positive integer")
    return AgentMessage(batch, True, tuple(models), bb)


def build_load(batch: EventBatch) -> bytes:
    return json.dumps({"v": VERSION, "kind": "load", "batch": batch.to_json()},
                      separators=(",", ":")).encode()


def parse_load(data: bytes, subject_token: str) -> EventBatch:
    return _batch(_load(data, "load"), subject_token, load=True)


def _batch(obj: dict, subject_token: str, *, load: bool) -> EventBatch:
    """The message's ``batch`` — with ``load``, a load and no events — which must come
    from the worker its subject names."""
    try:
        batch = parse_batch(obj.get("batch"))
    except RequestError as exc:
        raise BadMessage("bad_batch", str(exc)) from None
    if load and (batch.load is None or batch.events):
        raise BadMessage("bad_load", "a load message carries a load and no events")
    if worker_token(batch.worker_id) != subject_token:
        raise BadMessage("wrong_subject", f"worker {batch.worker_id!r} on another worker's subject")
    return batch


def build_snapshot_request(worker_id: str, replica: str) -> bytes:
    return json.dumps({"v": VERSION, "kind": "snapshot_request", "worker_id": worker_id,
                       "replica": replica}).encode()


def parse_snapshot_request(data: bytes) -> str:
    """The worker id asked for."""
    obj = _load(data, "snapshot_request")
    wid = obj.get("worker_id")
    if not isinstance(wid, str) or not wid:
        raise BadMessage("bad_snapshot_request", "'worker_id' must be a non-empty string")
    return wid


# ----------------------------------------------------------------- routers


class RouterMessage:
    """One replica's pick-time state (see the module docstring)."""

    __slots__ = ("replica", "seq", "block_bytes", "full", "inflight", "hints", "bye", "repl")

    def __init__(self, replica: str, seq: int, block_bytes: int, full: bool,
                 inflight: dict[str, tuple[int, int]], hints: list[tuple[str, float, list[int]]],
                 bye: bool = False, repl: list | None = None) -> None:
        self.replica = replica
        self.seq = seq
        self.block_bytes = block_bytes
        self.full = full
        self.inflight = inflight
        self.hints = hints
        self.bye = bye
        #: policies.replication decisions: (op, key, depth, worker)
        self.repl = repl or []

    def to_bytes(self) -> bytes:
        return json.dumps({
            "v": VERSION, "kind": "router", "replica": self.replica, "seq": self.seq,
            "block_bytes": self.block_bytes, "full": self.full,
            "inflight": {w: [r, t] for w, (r, t) in self.inflight.items()},
            "hints": [[w, round(age, 4), hs] for w, age, hs in self.hints],
            "repl": [list(r) for r in self.repl],
            "bye": self.bye}, separators=(",", ":")).encode()


def _nonneg_int(v: Any) -> bool:
    return type(v) is int and v >= 0


def parse_router(data: bytes) -> RouterMessage:
    obj = _load(data, "router")
    replica, seq, bb = obj.get("replica"), obj.get("seq"), obj.get("block_bytes")
    if not isinstance(replica, str) or not replica:
        raise BadMessage("bad_router", "'replica' must be a non-empty string")
    if not _nonneg_int(seq) or not _nonneg_int(bb):
        raise BadMessage("bad_router", "'seq' and 'block_bytes' must be integers >= 0")
    full, bye = obj.get("full", False), obj.get("bye", False)
    if not isinstance(full, bool) or not isinstance(bye, bool):
        raise BadMessage("bad_router", "'full' and 'bye' must be booleans")
    raw_if = obj.get("inflight", {})
    if not isinstance(raw_if, dict):
        raise BadMessage("bad_router", "'inflight' must be an object")
    inflight: dict[str, tuple[int, int]] = {}
    for w, v in raw_if.items():
        if not (isinstance(v, list) and len(v) == 2 and _nonneg_int(v[0]) and _nonneg_int(v[1])):
            raise BadMessage("bad_router", f"'inflight.{w}' must be [requests, tokens] >= 0")
        inflight[w] = (v[0], v[1])
    raw_h = obj.get("hints", [])
    if not isinstance(raw_h, list):
        raise BadMessage("bad_router", "'hints' must be a list")
    hints = []
    for h in raw_h:
        if not (isinstance(h, list) and len(h) == 3 and isinstance(h[0], str)
                and isinstance(h[1], (int, float)) and not isinstance(h[1], bool)
                and isinstance(h[2], list)
                and all(type(x) is int and 0 <= x < 1 << 64 for x in h[2])):
            raise BadMessage("bad_router", "a hint must be [worker, age_s, [64-bit keys]]")
        hints.append((h[0], max(0.0, float(h[1])), h[2]))
    raw_r = obj.get("repl", [])
    if not isinstance(raw_r, list):
        raise BadMessage("bad_router", "'repl' must be a list")
    repl = []
    for r in raw_r:
        if not (isinstance(r, list) and len(r) == 4 and r[0] in ("add", "retire")
                and type(r[1]) is int and 0 <= r[1] < 1 << 64 and type(r[2]) is int
                and r[2] > 0 and isinstance(r[3], str) and r[3]):
            raise BadMessage("bad_router", "a replication entry must be [add|retire, key, "
                             "depth, worker]")
        repl.append((r[0], r[1], r[2], r[3]))
    return RouterMessage(replica, seq, bb, full, inflight, hints, bye, repl)
