"""Agent -> router feedback: the wire format of contract 2, shared by both sides.

One HTTP request carries one batch::

    POST /internal/v1/events            Authorization: Bearer $RADIXFLEET_AGENT_TOKEN
    {
      "worker_id": "w0",                # the agent's id (its --worker-id)
      "url": "http://127.0.0.1:9001",   # where the router reaches it
      "epoch": "5f2c...",               # random per agent process start
      "seq": 17,                        # batch number within the epoch, from 0
      "events": [
        {"type": "snapshot", "blocks": [[hash, parent_or_null], ...],  # parent first
         "tiers": {"cpu": [h, ...]}},                                  # optional
        {"type": "stored",   "parent": hash_or_null, "hashes": [h1, h2, ...],
         "tier": "cpu"},                                               # optional
        {"type": "removed",  "hashes": [h, ...], "tier": "cpu"},         # optional
        {"type": "cleared"}
      ],
      "load": {"queued_requests": 0, "queued_tokens": 0, "running_requests": 0,
               "kv_used_tokens": 0, "kv_capacity_tokens": 0,
               "prefill_tokens_per_s": 0.0}
    }

``stored`` is a chain: ``hashes[0]``'s parent is ``parent`` (null: the root),
``hashes[i]``'s parent is ``hashes[i-1]``. A ``snapshot`` replaces everything the
router believes the worker holds, in every tier.

KV tiers. ``tier`` names where a ``stored``/``removed`` event's blocks live:
``"gpu"`` (the default: an event without the field, as every agent sent before
tiers existed) or a colder tier the agent copies KV down to (``"cpu"``: its DRAM
tier, ``radixfleet_tools.agent.dram_tier``; ``"disk"``). A colder tier is a set of blocks
beside the GPU tree (the router's ``PrefixIndex.tier_add``): ``parent`` is ignored
there. A snapshot's optional ``tiers`` lists each colder tier's blocks. A
``cleared`` empties every tier. A tier name is a string of at most
``MAX_TIER_NAME`` characters (else 400); a well-formed name the router does not
know (``TIERS``) is counted and its event ignored, so a newer agent's tier never
breaks an older router's stream. Interoperation: an older router reads a ``tier``
field it does not know as a GPU event, so the agent sends colder-tier events only
to routers whose registration answer lists the tier (``"tiers": [...]``); on the
bus (no answer to read) it always sends them: routers on a bus carrying an agent
with a DRAM tier must read tiers.

Answers (JSON ``{"status": ...}``):

    200 ok                   applied
    409 snapshot_required    sequence gap or unknown epoch: next batch must start
                             with a snapshot (the agent collapses its backlog)
    404 unknown_worker       not registered: the agent re-registers, then snapshots
    400 / 401                malformed / bad token

Registration: ``POST /internal/v1/register`` with ``{"worker_id", "url", "epoch",
"models": [...], "block_bytes": 128}``, answered ``200 {"status": "ok"}``; ``409
worker_id_taken`` when a worker at another URL holds the id, ``429`` with
``Retry-After`` past the router's bound on new self-registered workers. The ``200``
answer lists the colder tiers the router reads (``"tiers": ["cpu", "disk"]``). A batch is
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
``scheduling_policy`` (optional) is the agent's waiting order (its ``--schedule``:
``fcfs``, ``lpm``, ``priority``); an agent that says ``priority`` gets each request's
class as vLLM's body ``priority`` (radixfleet.engines.manager.forward_body), one that says
another gets none, whatever its worker entry says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixfleet.wire.errors import MalformedRequest
from radixfleet.wire.identifiers import id_problem, models_problem

STATUS_OK = "ok"
STATUS_SNAPSHOT_REQUIRED = "snapshot_required"
STATUS_UNKNOWN_WORKER = "unknown_worker"
STATUS_BLOCK_BYTES_MISMATCH = "block_bytes_mismatch"
#: registration refused: the id is held by a worker at another URL
STATUS_WORKER_ID_TAKEN = "worker_id_taken"
#: registration refused: the agent's role contradicts its configured entry's
STATUS_WORKER_ROLE_CONFLICT = "worker_role_conflict"
#: registration refused (429): too many new epochs at one URL in a minute
STATUS_EPOCH_CHURN = "epoch_churn"

EVENTS_PATH = "/internal/v1/events"
REGISTER_PATH = "/internal/v1/register"

_U64 = 2**64

#: the GPU tier: the worker's prefix cache itself (an event without ``tier``)
TIER_GPU = "gpu"
#: every tier this protocol version names, warmest first (the colder ones are
#: ``radixfleet.index.prefix_index.COLDER_TIERS``)
TIERS = (TIER_GPU, "cpu", "disk")
#: longest tier name a batch may carry
MAX_TIER_NAME = 32

#: Bounds of every reported load number. Counts (requests, tokens) are integers in
#: [0, MAX_LOAD_COUNT] (2^48 tokens is ~3,000x the KV of the largest GPU node);
#: ``prefill_tokens_per_s`` is a finite number in [0, MAX_RATE] (0: not measured).
#: Within one report, the worker's own limits hold: ``kv_used_tokens`` is at most
#: ``kv_capacity_tokens`` (when that is reported: > 0), ``queued_prefill_tokens``
#: (a part of the queue) at most ``queued_tokens``. A report outside them is refused
#: (400 naming the field), so no policy ever sees one: a 401-digit
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
    tier: str = TIER_GPU


@dataclass(slots=True)
class Removed:
    hashes: list[int]
    type: str = "removed"
    tier: str = TIER_GPU


@dataclass(slots=True)
class Cleared:
    type: str = "cleared"


@dataclass(slots=True)
class Snapshot:
    #: (hash, parent) pairs, every parent listed before its children
    blocks: list[tuple[int, int | None]]
    type: str = "snapshot"
    #: colder tier -> the blocks held there (empty: none, or not reported)
    tiers: dict[str, list[int]] = field(default_factory=dict)


Event = Stored | Removed | Cleared | Snapshot


@dataclass(slots=True)
class Load:
    """An agent's load report; the router ignores it once stale.

    Two counts of one queue, each plus the rest of every prompt in prefill:
    ``queued_tokens`` counts every waiting prompt whole (what routing policies and
    load shedding weigh: past saturation a waiting prompt's prefix is often evicted
    before its turn);
    ``queued_prefill_tokens`` only the part the worker's cache does not hold when the
    report is made (``radixfleet_tools.agent.scheduler`` says which part; load shedding keeps
    it beside each decision, ``radixfleet.route.shedding`` says why it judges the whole count). A report
    without
    the second field (an older agent), or a ``Load`` built without it, reads it as
    ``queued_tokens``; for an engine that reports only a count the router estimates
    one figure for both (``radixfleet.engines.queue_estimate``).
    """

    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    #: -1 (the default): as ``queued_tokens``
    queued_prefill_tokens: int = -1

    def __post_init__(self) -> None:
        if self.queued_prefill_tokens < 0:
            self.queued_prefill_tokens = self.queued_tokens


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
    out: dict[str, Any]
    if isinstance(e, Stored):
        out = {"type": "stored", "parent": e.parent, "hashes": e.hashes}
    elif isinstance(e, Removed):
        out = {"type": "removed", "hashes": e.hashes}
    elif isinstance(e, Snapshot):
        out = {"type": "snapshot", "blocks": [list(b) for b in e.blocks]}
        if e.tiers:
            out["tiers"] = {t: list(hs) for t, hs in e.tiers.items()}
        return out
    else:
        return {"type": "cleared"}
    if e.tier != TIER_GPU:
        out["tier"] = e.tier
    return out


def is_tiered(e: Event) -> bool:
    """Whether ``e`` carries colder-tier blocks (an event an older router misreads)."""
    if isinstance(e, (Stored, Removed)):
        return e.tier != TIER_GPU
    return False


def _tier(v: Any, where: str) -> str:
    if v is None:
        return TIER_GPU
    if not isinstance(v, str) or not 0 < len(v) <= MAX_TIER_NAME:
        raise MalformedRequest(
            f"'{where}' must be a tier name of 1 to {MAX_TIER_NAME} characters", param="events"
        )
    return v


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
    """Validates a load report (see ``MAX_LOAD_COUNT``, ``MAX_RATE`` and the limits
    across fields beside them); a missing field is 0, a missing
    ``queued_prefill_tokens`` is ``queued_tokens`` (``Load``). Raises
    ``MalformedRequest`` naming the field."""
    vals: dict[str, Any] = {}
    for f, typ in _LOAD_FIELDS.items():
        v = raw.get(f, 0) if f != "queued_prefill_tokens" else raw.get(f, vals["queued_tokens"])
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
    cap = vals["kv_capacity_tokens"]
    if cap and vals["kv_used_tokens"] > cap:
        raise MalformedRequest(
            f"'load.kv_used_tokens' {vals['kv_used_tokens']} is more than the worker's own "
            f"'load.kv_capacity_tokens' {cap}",
            param="load",
        )
    if vals["queued_prefill_tokens"] > vals["queued_tokens"]:
        raise MalformedRequest(
            f"'load.queued_prefill_tokens' {vals['queued_prefill_tokens']} is more than "
            f"'load.queued_tokens' {vals['queued_tokens']} (it counts a part of that queue)",
            param="load",
        )
    return Load(**vals)


@dataclass(frozen=True, slots=True)
class Registration:
    """An agent's registration, over HTTP (``POST /internal/v1/register``) or on the
    bus (a snapshot's ``register`` section with its batch's worker id, url, epoch).
    The URL's form is the router's to check (``radixfleet.config.parse_worker_url``)."""

    worker_id: str
    url: str
    epoch: str
    models: tuple[str, ...] = ()
    #: the block size the agent hashes with; None: not said (accepted as before)
    block_bytes: int | None = None
    #: its disaggregated role: prefill, decode or both (colocated; the default)
    role: str = "both"
    #: its waiting order ("fcfs", "lpm", "priority"); "": not said
    scheduling_policy: str = ""


def parse_registration(body: Any) -> Registration:
    """Validates a registration (the module docstring; identifiers bounded by
    ``radixfleet.wire.identifiers``). Raises ``MalformedRequest`` naming the field."""
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
    sp = body.get("scheduling_policy", "")
    name_ok = isinstance(sp, str) and sp.isascii() and (not sp or sp.replace("_", "").isalnum())
    if not name_ok or len(sp) > 32:
        raise MalformedRequest(
            "'scheduling_policy' must be a short name (fcfs, lpm, priority)", param="scheduling_policy"
        )
    return Registration(body["worker_id"], body["url"], body["epoch"], tuple(models), bb, role, sp)


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
                    tier=_tier(ev.get("tier"), f"{where}.tier"),
                )
            )
        elif kind == "removed":
            events.append(
                Removed(
                    _hashes(ev.get("hashes"), f"{where}.hashes"), tier=_tier(ev.get("tier"), f"{where}.tier")
                )
            )
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
            raw_tiers = ev.get("tiers", {})
            if not isinstance(raw_tiers, dict):
                raise MalformedRequest(f"'{where}.tiers' must be an object", param="events")
            tiers = {
                _tier(t, f"{where}.tiers key"): _hashes(hs, f"{where}.tiers.{t}")
                for t, hs in raw_tiers.items()
            }
            events.append(Snapshot(pairs, tiers=tiers))
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
