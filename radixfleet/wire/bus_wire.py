"""What travels on the bus (docs/DESIGN.md contract 11): subjects and message bodies.

Every body is a JSON object with ``"v": 1`` and a ``"kind"``; anything else on our
subjects is *foreign* or *malformed* and raises ``BadMessage`` with a short cause word
(the receiver counts it per cause, logs it once, ignores it)::

    <prefix>.agent.<wtoken>      JetStream (the stream): one agent's event batches
        {"v":1, "kind":"agent", "batch": <radixfleet.wire.events batch JSON>,
         "register": {"models": [...], "block_bytes": 128, "role": "prefill",  # snapshots; role: not both
                      "scheduling_policy": "priority"}}  # said when set
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
         "turns": [[session | null, prompt_tokens], ...],   # one per hint, optional
         "repl": [["add"|"retire", key, depth, "w1"], ...],   # hot-root replication
         "bye": false}                               # true: the replica is leaving
    <prefix>.limits.<replica>    core NATS: what one replica took from its rate-limit
                                 buckets since its last such message (radixfleet.route.tenancy)
        {"v":1, "kind":"limits", "replica": "r1",
         "epoch": 1767225600000, "seq": 7,          # the sender's start (unix ms), 1, 2, ...
         "used": [["tenant"|"key", name, requests, tokens], ...]}   # net, may be < 0

``wtoken`` is the worker id in hex (ids hold dots and colons, which subjects cannot).
In-flight counts travel as absolute values per worker, not as deltas, so a lost
message is healed by the next one for that worker (at the latest the heartbeat).
A hint's age is seconds since the pick on the sender, so clocks need not agree.
A limits message is a debit, not an absolute value, so each one must count once:
``epoch`` is when the sending process started (unix ms; a restart is a later epoch)
and ``seq`` numbers its limits messages 1, 2, ... within it. A receiver applies a
message only when its ``(epoch, seq)`` is above the last it applied from that replica
(``Sequences``) and drops the rest (``replayed``): a signed message captured and
published again, however many times within ``max_skew_s``, is charged once. A message
without both numbers (a sender that predates them) is dropped (``unsequenced``):
until every replica is upgraded, limits are shared only among the upgraded ones.
A hint's *turn* (``turns``, parallel to ``hints``; a sender that predates it omits
it and older receivers ignore it) is what the policy's record of a pick needs
beyond the keys: the request's session key and its prompt tokens (the keys cover
only its whole blocks). The session key travels as a digest, never as the
client's ``x-session-id`` or ``user`` (an end user's identifier):
``session_key(secret, s) = hex(HMAC-SHA256(secret, "radixfleet-session\\0" s))[:32]``
with the deployment's salt secret (``radixfleet.common.tenancy``), which every replica of
a bus shares, so each replica keys the session alike and no one on the bus learns
the identifier; on the wire it is exactly 32 lower-case hex digits.

Everything received is checked here before anything applies it, with the bounds
the HTTP agent API uses: batches and loads by ``radixfleet.wire.events`` (load numbers
within ``MAX_LOAD_COUNT`` / ``MAX_RATE``), registrations by
``events.parse_registration`` (identifiers by ``radixfleet.wire.identifiers``), and the
routers' numbers here: in-flight counts within ``MAX_LOAD_COUNT``, hint ages finite
in [0, ``MAX_HINT_AGE_S``], keys 64-bit, at most ``MAX_ENTRIES`` entries per list.
JSON is RFC 8259 only (no NaN or Infinity; a number beyond a float is refused).

Authentication (``BusKey``): the bus is a trust boundary as wide as the agent API,
so a message counts only when signed with the agent credential. With an agent
token set, every publication carries the header::

    Radixfleet-Signature: v1 <unix ms> <hex HMAC-SHA256>
        key  = HMAC-SHA256(agent token, "radixfleet bus v1")
        MAC  = HMAC-SHA256(key, "radixfleet-bus-v1\n" subject "\n" ms "\n" body)

and a receiver drops (``unsigned``, ``bad_signature``) whatever does not verify,
and (``stale``) a signed message dated more than ``max_skew_s`` from when it was
stored (stream messages: the server's store time, so the warm-start replay of old
history still verifies while a captured message published again does not) or
received (core messages). The subject is signed, so a message cannot be moved to
another worker's subject. Why a signature rather than NATS subject permissions
alone: it is the credential the HTTP API already requires, checked by the code
that applies the message, on any NATS server, with nothing to get right in the
server's permission config; NATS accounts and permissions (``deploy/README.md``,
"Securing the bus") are the second wall that keeps strangers off the bus at all.
Agents and routers hold the same token, so an agent can sign a router message:
the signature keeps out whoever lacks the fleet's credential, not one agent from
another. Without an agent token nothing is signed or checked: as the HTTP agent
API, that is allowed only on loopback (the router and agent refuse a tokenless
bus on any other host).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from radixfleet.wire import strict_json
from radixfleet.wire.errors import ConfigError, RequestError
from radixfleet.wire.events import MAX_LOAD_COUNT, EventBatch, Load, Snapshot, parse_batch, parse_registration
from radixfleet.wire.identifiers import MAX_ID_CHARS, MAX_NAME_CHARS, id_problem

#: what a stream name, subject prefix or replica id may hold (NATS tokens: no dots,
#: spaces or wildcards)
NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def check_url(url: str, key: str = "bus.url") -> None:
    """Raises ``ConfigError`` (at ``key``) unless ``url`` is ``nats://host[:port]`` or
    ``tls://host[:port]``, without credentials (they would be logged and shown: they
    go in their own settings)."""
    parts = urlsplit(url)
    if parts.scheme not in ("nats", "tls") or not parts.hostname:
        raise ConfigError(
            key, f"expected nats://host:port or tls://host:port, got {url.rpartition('@')[2]!r}"
        )
    if "@" in parts.netloc:
        raise ConfigError(
            key, "credentials do not go in the URL (it is logged and shown): use the bus's auth settings"
        )
    try:
        parts.port  # noqa: B018 - reading it validates the port
    except ValueError:
        raise ConfigError(key, f"invalid port in {url!r}") from None


def check_name(value: str, key: str) -> None:
    """Raises ``ConfigError`` (at ``key``) unless ``value`` is one NATS subject token."""
    if not NAME.match(value) or len(value) > MAX_ID_CHARS:
        raise ConfigError(key, f"expected 1..{MAX_ID_CHARS} letters, digits, '_' or '-', got {value[:200]!r}")


VERSION = 1
#: the JetStream header that makes a message replace every earlier one on its subject
ROLLUP_HEADER = {"Nats-Rollup": "sub"}

#: most entries in one list of a router message (in-flight workers, hints, hint keys,
#: replication decisions); a real fleet's heartbeat lists each worker once
MAX_ENTRIES = 65536
#: oldest pick-time hint accepted (seconds); real ones are a flush old
MAX_HINT_AGE_S = 3600.0
#: largest sequence number or replication depth a message may carry
MAX_SEQ = 2**63 - 1
#: a session key on the wire: a digest (module docstring)
SESSION_KEY = re.compile(r"[0-9a-f]{32}")
#: most entries in one limits message (a sender splits more into several)
MAX_LIMIT_ENTRIES = 1024
#: largest request or token count one limits entry may carry (either sign)
MAX_LIMIT_COUNT = float(1 << 53)
#: the rate limits a limits entry names: a tenant's, or a named API key's
LIMIT_KINDS = ("tenant", "key")
#: most senders whose last limits sequence a receiver keeps (``Sequences``)
MAX_SENDERS = 4096


class BadMessage(Exception):
    """A message the bus receiver ignores; ``cause`` labels the metric."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


#: the header with a message's signature (module docstring)
SIGNATURE_HEADER = "Radixfleet-Signature"
#: how far a signed message's date may be from its store or arrival time (seconds)
DEFAULT_MAX_SKEW_S = 30.0
_SIGNATURE = re.compile(r"v1 ([0-9]{1,16}) ([0-9a-f]{64})")


class BusKey:
    """Signs and checks bus messages with the agent credential (module docstring).
    An empty token signs nothing and accepts everything (loopback only)."""

    __slots__ = ("_key", "max_skew_s")

    def __init__(self, token: bytes | str, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        if isinstance(token, str):
            token = token.encode()
        self._key = hmac.new(token, b"radixfleet bus v1", hashlib.sha256).digest() if token else b""
        self.max_skew_s = max_skew_s

    @property
    def signs(self) -> bool:
        """True when messages are signed and checked."""
        return bool(self._key)

    def _mac(self, subject: str, ms: str, data: bytes) -> str:
        m = hmac.new(self._key, b"radixfleet-bus-v1\n", hashlib.sha256)
        m.update(subject.encode("utf-8", "surrogateescape") + b"\n" + ms.encode() + b"\n")
        m.update(data)
        return m.hexdigest()

    def sign(self, subject: str, data: bytes, now_s: float | None = None) -> dict[str, str]:
        """The headers to publish ``data`` on ``subject`` with ({} without a key)."""
        if not self._key:
            return {}
        ms = str(int((time.time() if now_s is None else now_s) * 1000))
        return {SIGNATURE_HEADER: f"v1 {ms} {self._mac(subject, ms, data)}"}

    def verify(
        self, subject: str, data: bytes, headers: Mapping[str, str] | None, ref_s: float | None = None
    ) -> None:
        """Raises ``BadMessage`` (``unsigned``, ``bad_signature``, ``stale``) unless
        ``data`` on ``subject`` carries our signature dated within ``max_skew_s`` of
        ``ref_s`` (when it was stored or received; default: now)."""
        if not self._key:
            return
        raw = headers.get(SIGNATURE_HEADER) if headers else None
        if raw is None:
            raise BadMessage(
                "unsigned",
                f"no {SIGNATURE_HEADER} header: the sender lacks "
                "the agent token (or predates signed bus messages)",
            )
        m = _SIGNATURE.fullmatch(raw)
        if m is None or not hmac.compare_digest(m.group(2), self._mac(subject, m.group(1), data)):
            raise BadMessage("bad_signature", "the signature does not verify with this side's agent token")
        ref = time.time() if ref_s is None else ref_s
        skew = int(m.group(1)) / 1000 - ref
        if abs(skew) > self.max_skew_s:
            raise BadMessage(
                "stale",
                f"signed {skew:+.1f} s from when it was stored or "
                f"received (at most {self.max_skew_s:g} s): a replay, or "
                "clocks apart",
            )


def worker_token(worker_id: str) -> str:
    return worker_id.encode("utf-8", "surrogateescape").hex()


class Subjects:
    """The subjects under one prefix."""

    __slots__ = ("prefix", "agents", "routers", "loads", "all_limits")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.agents = f"{prefix}.agent.>"  # the stream's subjects
        self.routers = f"{prefix}.router.*"
        self.all_limits = f"{prefix}.limits.*"
        self.loads = f"{prefix}.load.*"

    def agent(self, worker_id: str) -> str:
        return f"{self.prefix}.agent.{worker_token(worker_id)}"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}.load.{worker_token(worker_id)}"

    def snapshot_request(self, worker_id: str) -> str:
        return f"{self.prefix}.ctl.snapshot.{worker_token(worker_id)}"

    def router(self, replica: str) -> str:
        return f"{self.prefix}.router.{replica}"

    def limits(self, replica: str) -> str:
        return f"{self.prefix}.limits.{replica}"

    def kind(self, subject: str) -> str:
        """The kind of message ``subject`` carries, a bounded metric label:
        ``agent``, ``load``, ``snapshot_request``, ``router``, ``limits``,
        ``jetstream`` (``$JS.``), ``inbox`` (``_INBOX.``) or ``other``. Case-blind
        (nats-py lowercases the server's error text, subjects with it)."""
        s = subject.lower()
        if s.startswith("$js."):
            return "jetstream"
        if s.startswith("_inbox."):
            return "inbox"
        head = self.prefix.lower() + "."
        if not s.startswith(head):
            return "other"
        token = s[len(head) :].split(".", 1)[0]
        if token == "ctl":
            return "snapshot_request"
        return token if token in ("agent", "load", "router", "limits") else "other"


def _load(data: bytes, kind: str) -> dict[str, Any]:
    # the nesting is bounded by the NATS payload and caught if too deep
    try:
        obj = strict_json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadMessage("not_json", "body is not JSON (RFC 8259, finite numbers)") from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION or "kind" not in obj:
        raise BadMessage("foreign", "not a radixfleet bus message (no v=1/kind)")
    if obj["kind"] != kind:
        raise BadMessage("wrong_kind", f"kind {obj['kind']!r} where {kind!r} belongs")
    return obj


# ------------------------------------------------------------------ agents


class AgentMessage:
    """One agent batch from the stream; ``register`` is set on snapshots."""

    __slots__ = ("batch", "models", "block_bytes", "register", "role", "scheduling_policy")

    def __init__(
        self,
        batch: EventBatch,
        register: bool,
        models: tuple[str, ...] = (),
        block_bytes: int | None = None,
        role: str = "both",
        scheduling_policy: str = "",
    ) -> None:
        self.batch = batch
        self.register = register
        self.models = models
        self.block_bytes = block_bytes
        self.role = role  # its disaggregated role (radixfleet.route.pd)
        self.scheduling_policy = scheduling_policy  # its waiting order ("": not said)


def build_agent(
    batch: EventBatch,
    models: list[str],
    block_bytes: int | None,
    role: str = "both",
    scheduling_policy: str = "",
) -> bytes:
    obj: dict[str, Any] = {"v": VERSION, "kind": "agent", "batch": batch.to_json()}
    if batch.events and isinstance(batch.events[0], Snapshot):
        obj["register"] = {"models": list(models), "block_bytes": block_bytes}
        if role != "both":  # said only when not the default (older routers ignore it)
            obj["register"]["role"] = role
        if scheduling_policy:
            obj["register"]["scheduling_policy"] = scheduling_policy
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
    try:
        r = parse_registration({**reg, "worker_id": batch.worker_id, "url": batch.url, "epoch": batch.epoch})
    except RequestError as exc:
        raise BadMessage("bad_register", str(exc)) from None
    return AgentMessage(batch, True, r.models, r.block_bytes, r.role, r.scheduling_policy)


def load_batch(worker_id: str, url: str, epoch: str, load: Load) -> EventBatch:
    """A load message's batch (``build_load``): the worker's load, no events."""
    return EventBatch(worker_id, url, epoch, 0, [], load)


def build_load(batch: EventBatch) -> bytes:
    return json.dumps(
        {"v": VERSION, "kind": "load", "batch": batch.to_json()}, separators=(",", ":")
    ).encode()


def parse_load(data: bytes, subject_token: str) -> EventBatch:
    return _batch(_load(data, "load"), subject_token, load=True)


def _batch(obj: dict[str, Any], subject_token: str, *, load: bool) -> EventBatch:
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
    problem = id_problem(batch.worker_id, "'worker_id'") or id_problem(batch.epoch, "'epoch'")
    if problem:
        raise BadMessage("bad_batch", problem)
    return batch


def build_snapshot_request(worker_id: str, replica: str) -> bytes:
    return json.dumps(
        {"v": VERSION, "kind": "snapshot_request", "worker_id": worker_id, "replica": replica}
    ).encode()


def parse_snapshot_request(data: bytes) -> str:
    """The worker id asked for."""
    obj = _load(data, "snapshot_request")
    wid = obj.get("worker_id")
    problem = id_problem(wid, "'worker_id'")
    if problem:
        raise BadMessage("bad_snapshot_request", problem)
    return cast(str, wid)  # id_problem found none: a valid id string


# ----------------------------------------------------------------- routers


class RouterMessage:
    """One replica's pick-time state (see the module docstring)."""

    __slots__ = ("replica", "seq", "block_bytes", "full", "inflight", "hints", "bye", "repl", "turns")

    def __init__(
        self,
        replica: str,
        seq: int,
        block_bytes: int,
        full: bool,
        inflight: dict[str, tuple[int, int]],
        hints: list[tuple[str, float, list[int]]],
        bye: bool = False,
        repl: list[Any] | None = None,
        turns: list[tuple[str | None, int]] | None = None,
    ) -> None:
        self.replica = replica
        self.seq = seq
        self.block_bytes = block_bytes
        self.full = full
        self.inflight = inflight
        self.hints = hints
        self.bye = bye
        #: radixfleet.policies.replication decisions: (op, key, depth, worker)
        self.repl = repl or []
        #: per hint (empty: none given), its request's session key and prompt tokens
        self.turns = turns or []

    def turn(self, i: int) -> tuple[str | None, int | None]:
        """Hint ``i``'s session key and prompt tokens (None, None: not given)."""
        return self.turns[i] if i < len(self.turns) else (None, None)

    def to_bytes(self) -> bytes:
        obj = {
            "v": VERSION,
            "kind": "router",
            "replica": self.replica,
            "seq": self.seq,
            "block_bytes": self.block_bytes,
            "full": self.full,
            "inflight": {w: [r, t] for w, (r, t) in self.inflight.items()},
            "hints": [[w, round(age, 4), hs] for w, age, hs in self.hints],
            "repl": [list(r) for r in self.repl],
            "bye": self.bye,
        }
        if self.turns:
            obj["turns"] = [list(t) for t in self.turns]
        return json.dumps(obj, separators=(",", ":")).encode()


def _count(v: Any) -> bool:
    """An in-flight count: what an agent's load report may say (radixfleet.wire.events)."""
    return type(v) is int and 0 <= v <= MAX_LOAD_COUNT


def _key(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 64


def _list(obj: dict[str, Any], name: str) -> list[Any]:
    v = obj.get(name, [])
    if not isinstance(v, list) or len(v) > MAX_ENTRIES:
        raise BadMessage("bad_router", f"'{name}' must be a list of at most {MAX_ENTRIES}")
    return v


def _worker(v: Any, where: str) -> str:
    problem = id_problem(v, where)
    if problem:
        raise BadMessage("bad_router", problem)
    return cast(str, v)  # id_problem found none: a valid id string


def parse_router(data: bytes) -> RouterMessage:
    """A replica's message, every number within the bounds the agent API applies
    (module docstring). Raises ``BadMessage`` (``bad_router``)."""
    obj = _load(data, "router")
    replica, seq, bb = obj.get("replica"), obj.get("seq"), obj.get("block_bytes")
    if not isinstance(replica, str) or len(replica) > MAX_ID_CHARS or not NAME.match(replica):
        raise BadMessage("bad_router", f"'replica' must be 1..{MAX_ID_CHARS} letters, digits, '_' or '-'")
    if not (type(seq) is int and 0 <= seq <= MAX_SEQ) or not _count(bb):
        raise BadMessage("bad_router", "'seq' and 'block_bytes' must be integers >= 0")
    full, bye = obj.get("full", False), obj.get("bye", False)
    if not isinstance(full, bool) or not isinstance(bye, bool):
        raise BadMessage("bad_router", "'full' and 'bye' must be booleans")
    raw_if = obj.get("inflight", {})
    if not isinstance(raw_if, dict) or len(raw_if) > MAX_ENTRIES:
        raise BadMessage("bad_router", f"'inflight' must be an object of at most {MAX_ENTRIES}")
    inflight: dict[str, tuple[int, int]] = {}
    for w, v in raw_if.items():
        _worker(w, "an 'inflight' worker id")
        if not (isinstance(v, list) and len(v) == 2 and _count(v[0]) and _count(v[1])):
            raise BadMessage(
                "bad_router",
                f"'inflight.{w}' must be [requests, tokens], each an integer in [0, {MAX_LOAD_COUNT}]",
            )
        inflight[w] = (v[0], v[1])
    hints = []
    for h in _list(obj, "hints"):
        if not (
            isinstance(h, list)
            and len(h) == 3
            and isinstance(h[1], (int, float))
            and not isinstance(h[1], bool)
            and 0 <= h[1] <= MAX_HINT_AGE_S
            and isinstance(h[2], list)
            and len(h[2]) <= MAX_ENTRIES
            and all(_key(x) for x in h[2])
        ):
            raise BadMessage(
                "bad_router",
                f"a hint must be [worker, age_s in [0, "
                f"{MAX_HINT_AGE_S:g}], [at most {MAX_ENTRIES} 64-bit keys]]",
            )
        hints.append((_worker(h[0], "a hint's worker id"), float(h[1]), h[2]))
    repl = []
    for r in _list(obj, "repl"):
        if not (
            isinstance(r, list)
            and len(r) == 4
            and r[0] in ("add", "retire")
            and _key(r[1])
            and type(r[2]) is int
            and 0 < r[2] <= MAX_SEQ
        ):
            raise BadMessage("bad_router", "a replication entry must be [add|retire, key, depth, worker]")
        repl.append((r[0], r[1], r[2], _worker(r[3], "a replication entry's worker id")))
    turns = []
    raw_turns = _list(obj, "turns")
    if raw_turns and len(raw_turns) != len(hints):
        raise BadMessage("bad_router", "'turns' must have one entry per hint")
    for t in raw_turns:
        if not (
            isinstance(t, list)
            and len(t) == 2
            and (t[0] is None or (isinstance(t[0], str) and SESSION_KEY.fullmatch(t[0])))
            and _count(t[1])
        ):
            raise BadMessage(
                "bad_router",
                "a turn must be [session key (32 hex digits) or null, "
                f"prompt tokens in [0, {MAX_LOAD_COUNT}]]",
            )
        turns.append((t[0], t[1]))
    return RouterMessage(replica, seq, cast(int, bb), full, inflight, hints, bye, repl, turns)


def session_key(secret: bytes, session: str) -> str:
    """A session's key on the bus and in every replica's policy (module docstring)."""
    mac = hmac.new(
        secret, b"radixfleet-session\x00" + session.encode("utf-8", "surrogateescape"), hashlib.sha256
    )
    return mac.hexdigest()[:32]


# ------------------------------------------------------------- rate limits


class LimitsMessage:
    """One replica's limits message (module docstring)."""

    __slots__ = ("replica", "epoch", "seq", "used")

    def __init__(self, replica: str, epoch: int, seq: int, used: list[tuple[str, str, float, float]]) -> None:
        self.replica = replica
        self.epoch = epoch  # the sender's start, unix ms
        self.seq = seq  # its limits messages numbered from 1 within the epoch
        self.used = used  # (kind, name, requests, tokens)


def build_limits(replica: str, epoch: int, seq: int, used: list[tuple[str, str, int, float]]) -> list[bytes]:
    """The limits messages of ``used`` ((kind, name, requests, tokens) entries),
    ``MAX_LIMIT_ENTRIES`` per message, numbered ``seq``, ``seq + 1``, ... (the
    caller's next sequence is ``seq + len(result)``)."""
    out = []
    for n, i in enumerate(range(0, len(used), MAX_LIMIT_ENTRIES)):
        chunk = [[k, name, r, round(t, 3)] for k, name, r, t in used[i : i + MAX_LIMIT_ENTRIES]]
        obj = {
            "v": VERSION,
            "kind": "limits",
            "replica": replica,
            "epoch": epoch,
            "seq": seq + n,
            "used": chunk,
        }
        out.append(json.dumps(obj, separators=(",", ":")).encode())
    return out


def _limit_count(v: Any) -> bool:
    return (
        isinstance(v, (int, float)) and not isinstance(v, bool) and -MAX_LIMIT_COUNT <= v <= MAX_LIMIT_COUNT
    )


def parse_limits(data: bytes, subject_token: str) -> LimitsMessage:
    """A replica's limits message. Raises ``BadMessage`` (``bad_limits``,
    ``wrong_subject``, ``unsequenced``)."""
    obj = _load(data, "limits")
    replica = obj.get("replica")
    if not isinstance(replica, str) or len(replica) > MAX_ID_CHARS or not NAME.match(replica):
        raise BadMessage("bad_limits", f"'replica' must be 1..{MAX_ID_CHARS} letters, digits, '_' or '-'")
    if replica != subject_token:
        raise BadMessage("wrong_subject", f"replica {replica!r} on another replica's subject")
    epoch, seq = obj.get("epoch"), obj.get("seq")
    if epoch is None or seq is None:
        raise BadMessage(
            "unsequenced",
            f"replica {replica!r} sends limits messages without 'epoch' and 'seq' (it predates "
            "sequenced limits: upgrade it); ignored, so they cannot be replayed",
        )
    if not (type(epoch) is int and 0 <= epoch <= MAX_SEQ and type(seq) is int and 0 < seq <= MAX_SEQ):
        raise BadMessage(
            "bad_limits", f"'epoch' must be an integer in [0, {MAX_SEQ}], 'seq' in [1, {MAX_SEQ}]"
        )
    raw = obj.get("used")
    if not isinstance(raw, list) or len(raw) > MAX_LIMIT_ENTRIES:
        raise BadMessage("bad_limits", f"'used' must be a list of at most {MAX_LIMIT_ENTRIES}")
    used = []
    for e in raw:
        if not (
            isinstance(e, list)
            and len(e) == 4
            and e[0] in LIMIT_KINDS
            and isinstance(e[1], str)
            and len(e[1]) <= MAX_NAME_CHARS
            and _limit_count(e[2])
            and _limit_count(e[3])
        ):
            raise BadMessage(
                "bad_limits",
                f"an entry must be [tenant|key, name (at most {MAX_NAME_CHARS} characters), "
                f"requests, tokens] with counts within {MAX_LIMIT_COUNT:g}",
            )
        used.append((e[0], e[1], float(e[2]), float(e[3])))
    return LimitsMessage(replica, epoch, seq, used)


class Sequences:
    """The last ``(epoch, seq)`` applied per sender, so that each message counts once
    (module docstring). ``accept`` is O(1) amortized.

    A sender not heard for ``forget_s`` is forgotten: that is safe once
    ``forget_s`` exceeds twice the signature's ``max_skew_s`` (with the delivery's
    latency), since anything it sent before is then ``stale`` to ``BusKey``; it also
    lets a replica restarted with its clock set back (an earlier epoch) count again
    once its old epoch is forgotten. At most ``max_senders`` are kept; past it the
    one heard longest ago is forgotten.

    Invariants (``check()``): at most ``max_senders`` entries, in the order they
    were last heard (oldest first), each at most ``forget_s`` old as of the last
    ``accept``.
    """

    __slots__ = ("forget_s", "max_senders", "_last")

    def __init__(self, forget_s: float, max_senders: int = MAX_SENDERS) -> None:
        self.forget_s = forget_s
        self.max_senders = max_senders
        #: sender -> (epoch, seq, when it last counted), oldest first
        self._last: OrderedDict[str, tuple[int, int, float]] = OrderedDict()

    def accept(self, sender: str, epoch: int, seq: int, now: float) -> bool:
        """True, and recorded, when ``(epoch, seq)`` is above the last applied from
        ``sender`` (or it is unknown); False for a replay or a late message."""
        last = self._last
        while last and now - next(iter(last.values()))[2] > self.forget_s:
            last.popitem(last=False)
        prev = last.get(sender)
        if prev is not None and (epoch, seq) <= prev[:2]:
            return False
        if prev is None and len(last) >= self.max_senders:
            last.popitem(last=False)
        last[sender] = (epoch, seq, now)
        last.move_to_end(sender)
        return True

    def __len__(self) -> int:
        return len(self._last)

    def check(self) -> None:
        assert len(self._last) <= self.max_senders, len(self._last)
        heard = [h for _, _, h in self._last.values()]
        assert heard == sorted(heard), heard
