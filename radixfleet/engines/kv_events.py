"""vLLM's and SGLang's KV-cache event batches: decoding and validation, no I/O.

One ZMQ message from an engine is three frames (``radixfleet.engines.zmq_events`` reads
them): the topic, an 8-byte big-endian sequence number, and a msgpack payload that
this module decodes::

    payload   = [ts, [event, ...]]  |  [ts, [event, ...], dp_rank]
                 ts: float (unix s)     dp_rank: int >= 0 | nil (SGLang omits it)
    event     = {"type": "BlockStored", "block_hashes": [...], ...}     map form
              | ["BlockStored", block_hashes, parent_block_hash, ...]    tagged array

vLLM 0.32 encodes each event as a map (msgspec ``tag=True``, not ``array_like``);
earlier vLLM releases, SGLang and Dynamo's relay send *tagged arrays*: the type name
first, then the fields in declaration order, trailing fields that hold their default
left out (msgspec ``omit_defaults``). Both forms are accepted. Field order (vLLM
0.32's ``distributed/kv_events.py``; every older shape is a prefix of it)::

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                      medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
    BlockRemoved      block_hashes, medium, group_idx, ...
    AllBlocksCleared  (none)

Validation (strict: a peer's bytes decide nothing we have not checked):

- A *block hash* is a 64-bit integer, signed or unsigned — SGLang sends signed
  int64 (``hash_str_to_int64``), vLLM unsigned — normalised to ``h mod 2**64``; or
  ``bytes`` (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` sends raw digests),
  normalised with vLLM's own rule, the low 64 bits of the big-endian integer. Bools,
  floats and anything else are refused.
- ``token_ids`` are ints in [0, 2**32) (stored as ``array('I')``, what
  ``radixfleet.keys.token_block_hashes`` reads without a copy); ``block_size`` an
  int >= 0. Either ``token_ids`` is empty — vLLM's offloading tiers send
  placeholders with no tokens and ``block_size`` 0 — or ``block_size > 0`` and
  ``len(token_ids)`` is a multiple of it and at least ``len(block_hashes) *
  block_size``. Equality is the normal case (``EngineBlockStored.aligned``); vLLM
  sends *more* tokens than blocks only for groups whose masked or null blocks it
  skipped (sliding window, Mamba), where the tokens cannot be matched to hashes, so
  the block map skips those events as unaligned rather than this module refusing a
  batch an engine legitimately sends.
- ``extra_keys`` is nil or one entry (nil or an array) per block hash.
- ``lora_id``, ``group_idx``: nil or int (``group_idx`` >= 0); ``medium``,
  ``lora_name``, ``kv_cache_spec_kind``: nil or str. Map-form fields that are absent
  read as nil, except ``block_hashes``, ``token_ids`` and ``block_size``.
- Fields this module does not know are ignored (forward compatibility: vLLM 0.32
  already sends ``kv_cache_spec_sliding_window``, ``locality``, ``ownership``,
  ``session_id``).

Errors. A batch that is not msgpack, not the batch shape, or holds a *known* event
with a bad field is refused whole: ``KvEventError(cause, detail)``. Dropping only the
bad event would silently leave the index untrue (a lost removal keeps a block the
engine no longer has), so the subscriber reports a refused batch as lost (a gap) and
the block map drops the worker's entries, exactly as for a sequence gap. An event of
an *unknown type* is skipped and listed in ``DecodedBatch.unknown`` — forward
compatibility: a newer engine may add informational events — and the rest of the
batch applies. ``KvEventCause`` is the small fixed set of causes (the metric label).

Events are ``NamedTuple``s: immutable, no per-instance dict, typed, and about four
times cheaper to build than a frozen dataclass (~0.5 against ~2 us), which counts at
one event per block (SGLang publishes one ``BlockStored`` per page, vLLM one
``BlockRemoved`` per evicted block). Dispatch on ``ev.__class__``, not on tuple
equality.

Cost: one ``msgpack.unpackb`` (C) per batch; the checks per token run in C
(``set(map(type, ...))`` and ``array('I', ...)``), per hash in a short Python loop.
``radixfleet bench events`` measures decode + map + index together.
"""

from __future__ import annotations

import enum
import math
import reprlib
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from radixfleet.wire.errors import RadixfleetError

_U64 = 1 << 64
_MASK64 = _U64 - 1
_I64_MIN = -(1 << 63)


class KvEventCause(str, enum.Enum):
    """Why (part of) an event stream was refused. The value is the metric label.

    The first four come from decoding a payload (this module); the frame-level
    causes from the subscriber (``radixfleet.engines.zmq_events``), which reads them off
    the wire before a payload exists.
    """

    NOT_MSGPACK = "not_msgpack"  # payload is not one complete msgpack value
    BAD_SHAPE = "bad_shape"  # not [ts, [event...], dp_rank?], or an event not map/array
    UNKNOWN_TYPE = "unknown_type"  # an event type we do not know (event skipped)
    BAD_FIELD = "bad_field"  # a known event with a missing or ill-typed field
    BAD_FRAMES = "bad_frames"  # a message without exactly 3 frames (topic, seq, payload)
    BAD_SEQ = "bad_seq"  # the sequence frame is not 8 bytes
    BAD_TOPIC = "bad_topic"  # a topic other than the one subscribed (prefix match only)
    REPLAY_FAILED = "replay_failed"  # the replay endpoint did not answer in time / sanely
    CONSUMER_ERROR = "consumer_error"  # our consumer raised (a bug; logged with traceback)


class KvEventError(RadixfleetError):
    """A payload (or frame) refused. ``cause`` is a ``KvEventCause``, ``detail`` one
    short line naming the field or the shape seen (never the whole payload)."""

    def __init__(self, cause: KvEventCause, detail: str) -> None:
        super().__init__(f"{cause.value}: {detail}")
        self.cause = cause
        self.detail = detail


class EngineBlockStored(NamedTuple):
    """The engine cached ``block_hashes`` (a chain: each block's parent is the one
    before it, the first's is ``parent_block_hash``; None: the first block of a
    sequence). ``token_ids`` are the blocks' tokens, concatenated — generated tokens
    included, since the engine caches decoded blocks too."""

    block_hashes: tuple[int, ...]  # normalised to [0, 2**64)
    parent_block_hash: int | None  # normalised; None at the root
    token_ids: array  # array('I'); may be empty (an offload-tier placeholder)
    block_size: int  # tokens per block; 0 only with empty token_ids
    lora_id: int | None
    lora_name: str | None  # the adapter's name (what a request names as its model)
    medium: str | None  # "GPU", "CPU", "STORAGE", ... (None: unspecified, i.e. GPU)
    extra_keys: tuple[tuple | None, ...] | None  # per block, vLLM's untagged extra keys
    group_idx: int | None  # KV cache group (hybrid models have several)
    kv_cache_spec_kind: str | None  # e.g. "full_attention"

    @property
    def aligned(self) -> bool:
        """True when the tokens are exactly the blocks' tokens (see module docstring)."""
        return len(self.token_ids) == len(self.block_hashes) * self.block_size > 0


class EngineBlockRemoved(NamedTuple):
    """The engine evicted ``block_hashes`` (in any order; not necessarily leaves)."""

    block_hashes: tuple[int, ...]
    medium: str | None
    group_idx: int | None


class EngineAllCleared(NamedTuple):
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


#: one decoded event
EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared


class DecodedBatch(NamedTuple):
    """One payload decoded. ``unknown`` names the events skipped for their type."""

    ts: float  # the engine's wall clock when it published the batch (unix seconds)
    events: tuple[EngineEvent, ...]  # in the engine's order; apply in this order
    dp_rank: int | None  # the data-parallel rank that published it (None: not said)
    unknown: tuple[str, ...] = ()  # type names of skipped events, in order


# --------------------------------------------------------------------------- decoding


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decodes and validates one event-batch payload (module docstring).

    O(tokens + hashes). Raises ``KvEventError`` for a batch that must be treated as
    lost; never any other exception for any input bytes.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        # ExtraData, FormatError, StackError and UnicodeDecodeError are ValueErrors.
        raise KvEventError(KvEventCause.NOT_MSGPACK, _short(e)) from None
    if obj.__class__ is not list or not 2 <= len(obj) <= 3:
        raise KvEventError(KvEventCause.BAD_SHAPE, f"batch is {_kind(obj)}, want [ts, events, dp_rank?]")
    ts = obj[0]
    if ts.__class__ is int:
        ts = float(ts)
    if ts.__class__ is not float or not math.isfinite(ts):
        raise KvEventError(KvEventCause.BAD_SHAPE, f"batch ts is {_kind(ts)}, want a number")
    raw_events = obj[1]
    if raw_events.__class__ is not list:
        raise KvEventError(KvEventCause.BAD_SHAPE, f"batch events is {_kind(raw_events)}, want an array")
    dp_rank = obj[2] if len(obj) == 3 else None
    if dp_rank is not None and (dp_rank.__class__ is not int or dp_rank < 0):
        raise KvEventError(KvEventCause.BAD_SHAPE, f"batch dp_rank is {_kind(dp_rank)}, want int >= 0")
    events: list[EngineEvent] = []
    append = events.append
    unknown: list[str] = []
    parse: Callable[[Any, int], EngineEvent] | None
    for i, ev in enumerate(raw_events):
        cls = ev.__class__
        if cls is dict:
            tag = ev.get("type")
            parse = _MAP_PARSERS.get(tag) if tag.__class__ is str else None
        elif cls is list and ev:
            tag = ev[0]
            parse = _ARRAY_PARSERS.get(tag) if tag.__class__ is str else None
        else:
            raise KvEventError(
                KvEventCause.BAD_SHAPE, f"event {i} is {_kind(ev)}, want a map or tagged array"
            )
        if parse is None:
            if tag.__class__ is not str:
                raise KvEventError(KvEventCause.BAD_SHAPE, f"event {i} type is {_kind(tag)}, want a string")
            unknown.append(tag[:64])
            continue
        append(parse(ev, i))
    return DecodedBatch(ts, tuple(events), dp_rank, tuple(unknown))


# Field order of the tagged-array forms (vLLM 0.32's declarations; the tag is at 0):
#   BlockStored   1 block_hashes  2 parent_block_hash  3 token_ids  4 block_size
#                 5 lora_id  6 medium  7 lora_name  8 extra_keys  9 group_idx
#                 10 kv_cache_spec_kind  (11.. newer fields, ignored)
#   BlockRemoved  1 block_hashes  2 medium  3 group_idx  (4.. ignored)
def _stored_map(ev: dict, i: int) -> EngineBlockStored:
    get = ev.get
    return _stored(
        get("block_hashes", _MISSING),
        get("parent_block_hash"),
        get("token_ids", _MISSING),
        get("block_size", _MISSING),
        get("lora_id"),
        get("medium"),
        get("lora_name"),
        get("extra_keys"),
        get("group_idx"),
        get("kv_cache_spec_kind"),
        i,
    )


def _stored_array(ev: list, i: int) -> EngineBlockStored:
    n = len(ev)
    if n < 5:  # the first four fields have no default: always sent
        raise KvEventError(KvEventCause.BAD_FIELD, f"event {i} BlockStored: {n - 1} fields, want at least 4")
    if n < 11:
        ev = ev + [None] * (11 - n)
    return _stored(ev[1], ev[2], ev[3], ev[4], ev[5], ev[6], ev[7], ev[8], ev[9], ev[10], i)


def _stored(
    hashes, parent, toks, bs, lora_id, medium, lora_name, extra, group_idx, kind, i: int
) -> EngineBlockStored:
    hashes = _hash_list(hashes, "BlockStored", "block_hashes", i)
    if parent is not None:
        parent = _hash(parent, "BlockStored", "parent_block_hash", i)
    if bs.__class__ is not int or bs < 0:
        raise _bad("BlockStored", "block_size", i, bs, "int >= 0")
    toks = _token_array(toks, i)
    n = len(toks)
    if n and (bs == 0 or n % bs or n < len(hashes) * bs):
        raise KvEventError(
            KvEventCause.BAD_FIELD, f"event {i} BlockStored: {n} token_ids for {len(hashes)} blocks of {bs}"
        )
    if extra is not None:
        extra = _extra_keys(extra, len(hashes), i)
    if not (lora_id is None or lora_id.__class__ is int):
        raise _bad("BlockStored", "lora_id", i, lora_id, "nil or int")
    if not (group_idx is None or (group_idx.__class__ is int and group_idx >= 0)):
        raise _bad("BlockStored", "group_idx", i, group_idx, "nil or int >= 0")
    for name, v in (("medium", medium), ("lora_name", lora_name), ("kv_cache_spec_kind", kind)):
        if not (v is None or v.__class__ is str):
            raise _bad("BlockStored", name, i, v, "nil or str")
    return EngineBlockStored(hashes, parent, toks, bs, lora_id, lora_name, medium, extra, group_idx, kind)


def _removed_map(ev: dict, i: int) -> EngineBlockRemoved:
    get = ev.get
    return _removed(get("block_hashes", _MISSING), get("medium"), get("group_idx"), i)


def _removed_array(ev: list, i: int) -> EngineBlockRemoved:
    n = len(ev)
    if n < 2:
        raise KvEventError(KvEventCause.BAD_FIELD, f"event {i} BlockRemoved: block_hashes missing")
    return _removed(ev[1], ev[2] if n > 2 else None, ev[3] if n > 3 else None, i)


def _removed(hashes, medium, group_idx, i: int) -> EngineBlockRemoved:
    hashes = _hash_list(hashes, "BlockRemoved", "block_hashes", i)
    if not (medium is None or medium.__class__ is str):
        raise _bad("BlockRemoved", "medium", i, medium, "nil or str")
    if not (group_idx is None or (group_idx.__class__ is int and group_idx >= 0)):
        raise _bad("BlockRemoved", "group_idx", i, group_idx, "nil or int >= 0")
    return EngineBlockRemoved(hashes, medium, group_idx)


_CLEARED = EngineAllCleared()


def _cleared(ev, i: int) -> EngineAllCleared:
    return _CLEARED


_MAP_PARSERS: dict[str, Callable[[dict, int], EngineEvent]] = {
    "BlockStored": _stored_map,
    "BlockRemoved": _removed_map,
    "AllBlocksCleared": _cleared,
}
_ARRAY_PARSERS: dict[str, Callable[[list, int], EngineEvent]] = {
    "BlockStored": _stored_array,
    "BlockRemoved": _removed_array,
    "AllBlocksCleared": _cleared,
}


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "missing"


_MISSING = _Missing()


# ------------------------------------------------------------------------ field checks


def _hash(h: Any, ev: str, field: str, i: int) -> int:
    cls = h.__class__
    if cls is int:
        if _I64_MIN <= h < _U64:
            return h & _MASK64
    elif cls is bytes and 0 < len(h) <= 64:
        return int.from_bytes(h, "big") & _MASK64
    raise _bad(ev, field, i, h, "a 64-bit integer or digest bytes")


def _hash_list(v: Any, ev: str, field: str, i: int) -> tuple[int, ...]:
    if v.__class__ is not list:
        raise _bad(ev, field, i, v, "an array of hashes")
    for h in v:
        if h.__class__ is not int or not 0 <= h < _U64:
            # signed (SGLang), digests, or refused: the careful path
            return tuple([_hash(x, ev, field, i) for x in v])
    return tuple(v)


def _extra_keys(extra: Any, n: int, i: int) -> tuple:
    if extra.__class__ is not list or len(extra) != n:
        raise _bad("BlockStored", "extra_keys", i, extra, f"nil or {n} entries")
    out: list[tuple | None] = []
    for e in extra:
        if e is None:
            out.append(None)
        elif e.__class__ is list:
            out.append(tuple([tuple(x) if x.__class__ is list else x for x in e]))
        else:
            raise _bad("BlockStored", "extra_keys", i, e, "per-block nil or array")
    return tuple(out)


def _token_array(v: Any, i: int) -> array:
    if v.__class__ is not list:
        raise _bad("BlockStored", "token_ids", i, v, "an array of ints")
    if v and set(map(type, v)) != {int}:  # bools, floats, strings, nil: refused
        bad = next(t for t in v if t.__class__ is not int)
        raise _bad("BlockStored", "token_ids", i, bad, "ints")
    try:
        return array("I", v)
    except OverflowError:
        bad = next(t for t in v if not 0 <= t < 1 << 32)
        raise _bad("BlockStored", "token_ids", i, bad, "ints in [0, 2**32)") from None


def _bad(ev: str, field: str, i: int, got: Any, want: str) -> KvEventError:
    if got is _MISSING:
        return KvEventError(KvEventCause.BAD_FIELD, f"event {i} {ev}: {field} missing")
    return KvEventError(KvEventCause.BAD_FIELD, f"event {i} {ev}: {field} is {_kind(got)}, want {want}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 30, 30


def _kind(v: Any) -> str:
    """A short description of a value for an error line: its type and a bounded repr
    (reprlib: a peer's 1,000-deep nesting must not recurse in repr)."""
    return f"{type(v).__name__} {_REPR.repr(v)}"


def _short(e: BaseException, limit: int = 120) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= limit else s[: limit - 3] + "..."
