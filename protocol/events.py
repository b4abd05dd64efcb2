"""Agent -> router feedback: the wire format of contract 2, shared by both sides.

One HTTP request carries one batch::

    POST /internal/v1/events            Authorization: Bearer $RADIXFLEET_AGENT_TOKEN
    {
      "worker_id": "w0",                # the agent's id (its --worker-id)
      "url": "http://127.0.0.1:9001",   # where the router reaches it
      "epoch": "5f2c...",               # random per agent process start
      "seq": 17,                        # batch number within the epoch, from 0
      "events": [
        {"type": "snapshot", "blocks": [[hash, parent_or_null], ...]},  # parent first
        {"type": "stored",   "parent": hash_or_null, "hashes": [h1, h2, ...]},
        {"type": "removed",  "hashes": [h, ...]},
        {"type": "cleared"}
      ],
      "load": {"queued_requests": 0, "queued_tokens": 0, "running_requests": 0,
               "kv_used_tokens": 0, "kv_capacity_tokens": 0,
               "prefill_tokens_per_s": 0.0}
    }

``stored`` is a chain: ``hashes[0]``'s parent is ``parent`` (null: the root),
``hashes[i]``'s parent is ``hashes[i-1]``. A ``snapshot`` replaces everything the
router believes the worker holds.

Answers (JSON ``{"status": ...}``):

    200 ok                   applied
    409 snapshot_required    sequence gap or unknown epoch: next batch must start
                             with a snapshot (the agent collapses its backlog)
    404 unknown_worker       not registered: the agent re-registers, then snapshots
    400 / 401                malformed / bad token

Registration: ``POST /internal/v1/register`` with ``{"worker_id", "url", "epoch",
"models": [...], "block_bytes": 128}``, answered ``200 {"status": "ok"}``; ``409
worker_id_taken`` when a worker at another URL holds the id, ``429`` with
``Retry-After`` past the router's bound on new self-registered workers. A batch is
applied only from the URL and epoch its worker registered with; any other gets
``404 unknown_worker`` (so the agent re-registers, and is refused if the id is
someone else's).
``block_bytes`` is the block size the agent hashes with (its ``--block-bytes``);
when it differs from the router's ``keys.block_bytes`` every hash the agent
reports is one the router never looks up, so the router refuses it with
``409 {"status": "block_bytes_mismatch", "block_bytes": <the router's>}``
(an agent that omits the field is accepted as before; the agent keeps retrying,
so fixing either side's setting heals the link). A registered agent whose
``block_bytes`` no longer matches (the router's was reloaded) gets
``404 unknown_worker`` for its batches, re-registers, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.errors import MalformedRequest
from protocol.identifiers import id_problem, models_problem

STATUS_OK = "ok"
STATUS_SNAPSHOT_REQUIRED = "snapshot_required"
STATUS_UNKNOWN_WORKER = "unknown_worker"
STATUS_BLOCK_BYTES_MISMATCH = "block_bytes_mismatch"
#: registration refused: the id is held by a worker at another URL
STATUS_WORKER_ID_TAKEN = "worker_id_taken"

EVENTS_PATH = "/internal/v1/events"
REGISTER_PATH = "/internal/v1/register"

_U64 = 2**64

#: Bounds of every reported load number. Counts (requests, tokens) are integers in
#: [0, MAX_LOAD_COUNT] (2^48 tokens is ~3,000x the KV of the largest GPU node);
#: ``prefill_tokens_per_s`` is a finite number in [0, MAX_RATE] (0: not measured).
#: A report outside them is refused (400), so no policy ever sees one: a 401-digit
#: ``queued_tokens`` once made every routing decision raise OverflowError.
MAX_LOAD_COUNT = 2**48
MAX_RATE = 1e12
#: the slowest prefill rate a view may carry (tokens/s); slower reports are raised to it
MIN_RATE = 1.0


@dataclass(slots=True)
class Stored:
    parent: int | None
    hashes: list[int]
    type: str = "stored"


@dataclass(slots=True)
class Removed:
    hashes: list[int]
    type: str = "removed"


@dataclass(slots=True)
class Cleared:
    type: str = "cleared"


@dataclass(slots=True)
class Snapshot:
    #: (hash, parent) pairs, every parent listed before its children
    blocks: list[tuple[int, int | None]]
    type: str = "snapshot"


Event = Stored | Removed | Cleared | Snapshot


@dataclass(slots=True)
class Load:
    """An agent's load report; the router ignores it once stale."""

    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    prefill_tokens_per_s: float = 0.0


_LOAD_FIELDS = {f: (float if f == "prefill_tokens_per_s" else int) for f in Load.__slots__}


@dataclass(slots=True)
class EventBatch:
    worker_id: str
    url: str
    epoch: str
    seq: int
    events: list[Any] = field(default_factory=list)
    load: Load | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "worker_id": self.worker_id,
            "url": self.url,
            "epoch": self.epoch,
            "seq": self.seq,
            "events": [_event_json(e) for e in self.events],
        }
        if self.load is not None:
            out["load"] = {f: getattr(self.load, f) for f in _LOAD_FIELDS}
        return out


def _event_json(e: Event) -> dict[str, Any]:
    if isinstance(e, Stored):
        return {"type": "stored", "parent": e.parent, "hashes": e.hashes}
    if isinstance(e, Removed):
        return {"type": "removed", "hashes": e.hashes}
    if isinstance(e, Snapshot):
        return {"type": "snapshot", "blocks": [list(b) for b in e.blocks]}
    return {"type": "cleared"}


def _hash(v: Any, where: str) -> int:
    if type(v) is not int or not 0 <= v < _U64:
        raise MalformedRequest(f"'{where}' must be an unsigned 64-bit block hash")
    return v


def _hashes(v: Any, where: str) -> list[int]:
    if not isinstance(v, list):
        raise MalformedRequest(f"'{where}' must be a list of block hashes")
    for i, h in enumerate(v):
        _hash(h, f"{where}[{i}]")
    return v


def _str(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise MalformedRequest(f"'{key}' must be a non-empty string", param=key)
    return v


def parse_load(raw: dict[str, Any]) -> Load:
    """Validates a load report (see ``MAX_LOAD_COUNT``, ``MAX_RATE``). Raises
    ``MalformedRequest`` naming the field."""
    vals = {}
    for f, typ in _LOAD_FIELDS.items():
        v = raw.get(f, 0)
        if typ is int:
            if type(v) is not int or not 0 <= v <= MAX_LOAD_COUNT:
                raise MalformedRequest(
                    f"'load.{f}' must be an integer in [0, {MAX_LOAD_COUNT}]", param="load"
                )
        else:
            if (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_RATE
            ):  # False for NaN too
                raise MalformedRequest(f"'load.{f}' must be a number in [0, {MAX_RATE:g}]", param="load")
            v = float(v)
        vals[f] = v
    return Load(**vals)


@dataclass(frozen=True, slots=True)
class Registration:
    """An agent's registration, over HTTP (``POST /internal/v1/register``) or on the
    bus (a snapshot's ``register`` section with its batch's worker id, url, epoch).
    The URL's form is the router's to check (``router.config.parse_worker_url``)."""

    worker_id: str
    url: str
    epoch: str
    models: tuple[str, ...] = ()
    #: the block size the agent hashes with; None: not said (accepted as before)
    block_bytes: int | None = None
    #: its disaggregated role: prefill, decode or both (colocated; the default)
    role: str = "both"


def parse_registration(body: Any) -> Registration:
    """Validates a registration (the module docstring; identifiers bounded by
    ``protocol.identifiers``). Raises ``MalformedRequest`` naming the field."""
    if not isinstance(body, dict):
        raise MalformedRequest("registration must be a JSON object")
    for k in ("worker_id", "url", "epoch"):
        _str(body, k)
    for k in ("worker_id", "epoch"):
        problem = id_problem(body[k], f"'{k}'")
        if problem:
            raise MalformedRequest(problem, param=k)
    models = body.get("models", [])
    problem = models_problem(models)
    if problem:
        raise MalformedRequest(problem, param="models")
    bb = body.get("block_bytes")
    if bb is not None and (type(bb) is not int or not 0 < bb <= MAX_LOAD_COUNT):
        raise MalformedRequest(
            f"'block_bytes' must be an integer in [1, {MAX_LOAD_COUNT}]", param="block_bytes"
        )
    role = body.get("role", "both")
    if role not in ("prefill", "decode", "both"):
        raise MalformedRequest("'role' must be one of prefill, decode, both", param="role")
    return Registration(body["worker_id"], body["url"], body["epoch"], tuple(models), bb, role)


def parse_batch(body: Any) -> EventBatch:
    """Validates and parses an events batch. Raises ``MalformedRequest`` naming the field."""
    if not isinstance(body, dict):
        raise MalformedRequest("events batch must be a JSON object")
    seq = body.get("seq")
    if type(seq) is not int or seq < 0:
        raise MalformedRequest("'seq' must be a non-negative integer", param="seq")
    raw_events = body.get("events", [])
    if not isinstance(raw_events, list):
        raise MalformedRequest("'events' must be a list", param="events")
    events: list[Event] = []
    for i, ev in enumerate(raw_events):
        where = f"events[{i}]"
        if not isinstance(ev, dict):
            raise MalformedRequest(f"'{where}' must be an object", param="events")
        kind = ev.get("type")
        if kind == "stored":
            parent = ev.get("parent")
            events.append(
                Stored(
                    None if parent is None else _hash(parent, f"{where}.parent"),
                    _hashes(ev.get("hashes"), f"{where}.hashes"),
                )
            )
        elif kind == "removed":
            events.append(Removed(_hashes(ev.get("hashes"), f"{where}.hashes")))
        elif kind == "cleared":
            events.append(Cleared())
        elif kind == "snapshot":
            blocks = ev.get("blocks")
            if not isinstance(blocks, list):
                raise MalformedRequest(f"'{where}.blocks' must be a list", param="events")
            pairs = []
            for j, b in enumerate(blocks):
                if not isinstance(b, list) or len(b) != 2:
                    raise MalformedRequest(f"'{where}.blocks[{j}]' must be [hash, parent]", param="events")
                pairs.append(
                    (
                        _hash(b[0], f"{where}.blocks[{j}][0]"),
                        None if b[1] is None else _hash(b[1], f"{where}.blocks[{j}][1]"),
                    )
                )
            events.append(Snapshot(pairs))
        else:
            raise MalformedRequest(
                f"'{where}.type' {kind!r} is not one of stored, removed, cleared, snapshot",
                param="events",
            )
    load = None
    raw_load = body.get("load")
    if raw_load is not None:
        if not isinstance(raw_load, dict):
            raise MalformedRequest("'load' must be an object", param="load")
        load = parse_load(raw_load)
    return EventBatch(_str(body, "worker_id"), _str(body, "url"), _str(body, "epoch"), seq, events, load)
