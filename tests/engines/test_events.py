"""KV events from vLLM and SGLang: decoding, the block map, and the ZMQ subscriber.

Layers (STYLE.md 9):

- decoding: both wire forms built by hand per vLLM's field order, every malformed
  case with its cause, a seeded fuzz that must raise nothing but ``KvEventError``;
- the recorded real capture (``tests/data/vllm_kv_events.bin``, made by
  ``tests/data/capture_vllm_kv_events.py`` against vLLM 0.32): decoded, applied, and
  the index's prediction checked against vLLM's own ``cached_tokens``;
- the block map against ``FakeEngine``, a small model of vLLM's prefix cache that
  emits the events vLLM would (stored chains with parents, leaf evictions, clears),
  with ``index.check()`` and ``map.check(exclusive=True)`` after every batch and the
  index compared with the engine's true contents; a seeded randomized stress;
- a live ZMQ stream in-process: ``FakePublisher`` follows vLLM's ``ZmqEventPublisher``
  (PUB bind or connect, ROUTER replay with a bounded buffer; SGLang's replay framing
  too) -> ``KvEventSubscriber`` -> ``EngineBlockMap`` -> ``PrefixIndex``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from array import array
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from radixfleet.engines.block_map import EngineBlockMap
from radixfleet.engines.kv_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    KvEventCause,
    KvEventError,
    decode_batch,
)
from radixfleet.engines.zmq_events import (
    END_SEQ,
    KvEventSubscriber,
    replace_wildcard,
    subscriber_endpoint,
)
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import token_block_hashes
from tests.data.capture_vllm_kv_events import REPLAY, SUB, read_capture
from tests.engines.fake_engine import (
    BS,
    U64,
    FakeEngine,
    removed_map,
    removed_tagged,
    seed_of,
    stored_map,
    stored_tagged,
)

DATA = Path(__file__).parents[1] / "data"


def new_map(worker="w0", index=None, block_size=BS, **kw):
    index = index if index is not None else PrefixIndex()
    return EngineBlockMap(worker, index, seed_of, block_size=block_size, **kw), index


# ----------------------------------------------------------------- wire builders


def batch(events, ts=1.5e9, dp=0):
    return msgpack.packb([ts, events] if dp is ... else [ts, events, dp])


# ------------------------------------------------------------------------ decoding


def test_decode_map_form_like_vllm_032():
    ev = stored_map(
        [1, 2],
        None,
        range(8),
        lora_name=None,
        extra_keys=[None, None],
        kv_cache_spec_sliding_window=None,
        locality="LOCAL",
        session_id="s",
    )
    b = decode_batch(batch([ev, removed_map([2]), {"type": "AllBlocksCleared"}], dp=3))
    assert b.ts == 1.5e9 and b.dp_rank == 3 and b.unknown == ()
    s, r, c = b.events
    assert s == EngineBlockStored(
        (1, 2), None, array("I", range(8)), BS, None, None, "GPU", (None, None), 0, "full_attention"
    )
    assert s.aligned
    assert r == EngineBlockRemoved((2,), "GPU", 0)
    assert c == EngineAllCleared()


def test_decode_tagged_arrays_like_older_vllm_and_sglang():
    p = [
        0.5,
        [
            stored_tagged([7], 3, range(4), BS, None),  # SGLang / vLLM 0.8: 5 fields
            stored_tagged([8], 7, range(4, 8), BS, None, "GPU", "ad", [["ad"]], 0, "full"),
            removed_tagged([7]),
            removed_tagged([8], "CPU", 1),
            ["AllBlocksCleared"],
        ],
    ]
    b = decode_batch(msgpack.packb(p))  # SGLang's batch has no dp_rank
    assert b.dp_rank is None and b.ts == 0.5
    s1, s2, r1, r2, c = b.events
    assert s1.block_hashes == (7,) and s1.parent_block_hash == 3 and s1.medium is None
    assert s1.lora_name is None and s1.extra_keys is None and s1.group_idx is None
    assert s2.medium == "GPU" and s2.lora_name == "ad" and s2.extra_keys == (("ad",),)
    assert s2.group_idx == 0 and s2.kv_cache_spec_kind == "full"
    assert r1 == EngineBlockRemoved((7,), None, None)
    assert r2 == EngineBlockRemoved((8,), "CPU", 1)
    assert c == EngineAllCleared()


def test_decode_normalises_signed_and_digest_hashes():
    neg = -(1 << 63) + 5  # SGLang: hash_str_to_int64 -> signed int64
    digest = hashlib.sha256(b"x").digest()  # vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    b = decode_batch(batch([stored_tagged([neg, -1], digest, range(8))]))
    s = b.events[0]
    assert s.block_hashes == (neg % U64, U64 - 1)
    assert s.parent_block_hash == int.from_bytes(digest, "big") & (U64 - 1)
    b = decode_batch(batch([removed_map([digest, U64 - 1])]))
    assert b.events[0].block_hashes == (int.from_bytes(digest, "big") % U64, U64 - 1)


def test_unknown_event_type_is_skipped_not_the_batch():
    b = decode_batch(batch([{"type": "BlockUpdated", "x": 1}, removed_map([1]), ["SomethingNew", 1, 2]]))
    assert b.events == (EngineBlockRemoved((1,), "GPU", 0),)
    assert b.unknown == ("BlockUpdated", "SomethingNew")


def test_placeholder_and_masked_stored_events_decode():
    # vLLM's offloading tier: no tokens, block_size 0 (a placeholder)
    p = decode_batch(batch([stored_map([5], None, [], 0, medium="CPU")])).events[0]
    assert len(p.token_ids) == 0 and not p.aligned
    # a group whose masked blocks were skipped: more tokens than hashes x block_size
    m = decode_batch(batch([stored_map([5], None, range(12), BS, group_idx=1)])).events[0]
    assert len(m.token_ids) == 12 and not m.aligned


_ok = stored_map([1], None, range(BS))
MALFORMED = [
    (b"\xc1", KvEventCause.NOT_MSGPACK),  # never-used msgpack byte
    (b"\x93\x01", KvEventCause.NOT_MSGPACK),  # truncated
    (msgpack.packb([1.0, [], 0]) + b"\x00", KvEventCause.NOT_MSGPACK),  # trailing bytes
    (msgpack.packb([1.0, ["\xff"]])[:-1] + b"\xa1\xff", KvEventCause.NOT_MSGPACK),  # bad utf-8
    (msgpack.packb({"ts": 1.0}), KvEventCause.BAD_SHAPE),
    (msgpack.packb([1.0]), KvEventCause.BAD_SHAPE),
    (msgpack.packb([1.0, [], 0, 9]), KvEventCause.BAD_SHAPE),
    (msgpack.packb(["now", []]), KvEventCause.BAD_SHAPE),
    (msgpack.packb([float("nan"), []]), KvEventCause.BAD_SHAPE),
    (msgpack.packb([1.0, {}]), KvEventCause.BAD_SHAPE),
    (msgpack.packb([1.0, [], -1]), KvEventCause.BAD_SHAPE),
    (msgpack.packb([1.0, [], "0"]), KvEventCause.BAD_SHAPE),
    (batch([7]), KvEventCause.BAD_SHAPE),
    (batch([[]]), KvEventCause.BAD_SHAPE),
    (batch([{"block_hashes": [1]}]), KvEventCause.BAD_SHAPE),  # no type
    (batch([[3, [1]]]), KvEventCause.BAD_SHAPE),  # integer tag
    (batch([{**_ok, "block_hashes": "1"}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "block_hashes": [1.0]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "block_hashes": [True]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "block_hashes": ["abc"]}]), KvEventCause.BAD_FIELD),
    # (msgpack cannot carry an int outside [-2**63, 2**64): no out-of-range case exists)
    (batch([{**_ok, "block_hashes": [b"\x01" * 65]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "block_hashes": [None]}]), KvEventCause.BAD_FIELD),
    (batch([{k: v for k, v in _ok.items() if k != "block_hashes"}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "parent_block_hash": 1.5}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "parent_block_hash": b""}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "token_ids": [0, 1, 2, "3"]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "token_ids": [0, 1, 2, True]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "token_ids": [0, 1, 2, -3]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "token_ids": [0, 1, 2, 1 << 32]}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "token_ids": None}]), KvEventCause.BAD_FIELD),
    (batch([{k: v for k, v in _ok.items() if k != "token_ids"}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "token_ids": [0, 1, 2]}]), KvEventCause.BAD_FIELD),  # short
    (batch([{**_ok, "token_ids": [0, 1, 2, 3, 4]}]), KvEventCause.BAD_FIELD),  # not a multiple
    (batch([{**_ok, "block_size": 0}]), KvEventCause.BAD_FIELD),  # tokens, no block size
    (batch([{**_ok, "block_size": -4}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "block_size": 4.0}]), KvEventCause.BAD_FIELD),
    (batch([{k: v for k, v in _ok.items() if k != "block_size"}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "lora_id": "7"}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "lora_name": 7}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "medium": 1}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "group_idx": -1}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "kv_cache_spec_kind": []}]), KvEventCause.BAD_FIELD),
    (batch([{**_ok, "extra_keys": [None, None]}]), KvEventCause.BAD_FIELD),  # 2 for 1 block
    (batch([{**_ok, "extra_keys": ["salt"]}]), KvEventCause.BAD_FIELD),  # entry not an array
    (batch([stored_tagged([1], None, range(BS))[:4]]), KvEventCause.BAD_FIELD),  # no block_size
    (batch([removed_map("12")]), KvEventCause.BAD_FIELD),
    (batch([removed_tagged([1], 5)]), KvEventCause.BAD_FIELD),  # medium not a string
    (batch([_ok, removed_map([1.5])]), KvEventCause.BAD_FIELD),  # one bad event: whole batch
]


@pytest.mark.parametrize("payload,cause", MALFORMED)
def test_malformed_payloads_are_refused_with_their_cause(payload, cause):
    with pytest.raises(KvEventError) as ei:
        decode_batch(payload)
    assert ei.value.cause is cause
    assert len(str(ei.value)) < 200  # one short line, never the payload


def _random_value(rng, depth=0):
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(
            [
                None,
                True,
                False,
                0,
                -1,
                1 << 63,
                (1 << 64) - 1,
                -(1 << 63),
                1.5,
                float("inf"),
                "",
                "GPU",
                "x" * 100,
                b"",
                b"\x00" * 8,
                b"\x01" * 70,
                rng.randrange(1 << 32),
                rng.randrange(-5, 5),
            ]
        )
    if r < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {
        rng.choice(["type", "block_hashes", "x", 1, None]): _random_value(rng, depth + 1)
        for _ in range(rng.randint(0, 3))
    }


def test_structural_fuzz_raises_only_kv_event_errors():
    """Valid events with random values put in random fields (both wire forms)."""
    rng = random.Random(5)
    outcomes = set()
    for _ in range(4000):
        ev = rng.choice(
            [
                stored_map([1, 2], 7, range(2 * BS), extra_keys=[None, ["s"]]),
                removed_map([3]),
                stored_tagged([1], None, range(BS), BS, None, "GPU", "a", [["a"]], 0, "k"),
                removed_tagged([1], "GPU", 0),
            ]
        )
        if isinstance(ev, dict):
            ev[rng.choice(list(ev) + ["new"])] = _random_value(rng)
        else:
            ev[rng.randrange(len(ev))] = _random_value(rng)
        try:
            b = decode_batch(batch([ev, removed_map([5])]))
            outcomes.add("ok" if not b.unknown else "unknown")
        except KvEventError as e:
            outcomes.add(e.cause.value)
    assert {"ok", "bad_field", "bad_shape", "unknown"} <= outcomes


@pytest.mark.parametrize("depth", [500, 1000, 1023, 5000])
def test_deep_nesting_is_refused_without_recursion(depth):
    nested = b"\x91" * depth + b"\x01"
    for payload in (b"\x92" + nested + b"\x90", b"\x92\xcb" + bytes(8) + b"\x91" + nested):
        with pytest.raises(KvEventError) as ei:
            decode_batch(payload)
        assert len(str(ei.value)) < 200


def test_fuzz_decode_raises_only_kv_event_errors():
    rng = random.Random(12)
    good = [
        batch([stored_map([1, 2], None, range(8)), removed_map([1])]),
        batch([stored_tagged([U64 - 1], 3, range(4), 4, None, "GPU", "x", [["x"]])]),
        msgpack.packb([1.0, [["AllBlocksCleared"]]]),
    ]
    ok = refused = 0
    for _i in range(6000):
        p = bytearray(rng.choice(good))
        r = rng.random()
        if r < 0.4:
            for _ in range(rng.randint(1, 4)):
                p[rng.randrange(len(p))] = rng.randrange(256)
        elif r < 0.6:
            p = p[: rng.randrange(len(p))]
        elif r < 0.8:
            p = bytearray(rng.randbytes(rng.randint(0, 64)))
        else:
            p.insert(rng.randrange(len(p)), rng.randrange(256))
        try:
            decode_batch(bytes(p))
            ok += 1
        except KvEventError as e:
            assert isinstance(e.cause, KvEventCause)
            refused += 1
    assert ok and refused


# -------------------------------------------------------------- the real capture


def _capture():
    recs = read_capture(DATA / "vllm_kv_events.bin")
    meta = json.loads((DATA / "vllm_kv_events.json").read_text())
    return recs, meta


def test_real_capture_decodes_every_message_and_replay_answer():
    recs, meta = _capture()
    subs = [f for c, f in recs if c == SUB]
    replays = [f for c, f in recs if c == REPLAY]
    kinds = set()
    for i, frames in enumerate(subs):
        topic, seqb, payload = frames
        assert topic == b"kv-events" and int.from_bytes(seqb, "big") == i
        b = decode_batch(payload)
        assert b.dp_rank == 0 and b.unknown == ()
        kinds.update(type(e) for e in b.events)
        for e in b.events:
            if isinstance(e, EngineBlockStored):
                assert e.aligned and e.block_size == meta["block_size"] and e.medium == "GPU"
    assert kinds == {EngineBlockStored, EngineBlockRemoved, EngineAllCleared}
    # vLLM's replay answer: [b"", topic, seq, payload] per batch, then the end marker
    assert [f[3] for f in replays[:-1]] == [f[2] for f in subs]
    assert replays[-1] == [b"", b"", END_SEQ, b""]


def test_real_capture_index_predicts_vllms_cached_tokens():
    """Applying what vLLM published before each request, the index predicts exactly
    the cached tokens vLLM then reported (salted requests in their own namespace)."""
    recs, meta = _capture()
    bs = meta["block_size"]
    payloads = [f[2] for c, f in recs if c == SUB]
    bmap, index = new_map(block_size=bs)
    salted = next(r for r in meta["requests"] if r["cache_salt"])
    salted_at = next(
        i
        for i, p in enumerate(payloads)
        for e in decode_batch(p).events
        if isinstance(e, EngineBlockStored) and e.extra_keys and e.extra_keys[0] == (salted["cache_salt"],)
    )
    applied = 0

    def apply_next():
        nonlocal applied
        b = decode_batch(payloads[applied])
        bmap.apply(b.events, float(applied))
        index.check()
        bmap.check(exclusive=True)
        if applied == salted_at:
            # the salted prompt's own chain is keyed with the salt in its seed
            ids = salted["prompt_token_ids"]
            full = token_block_hashes(ids, bs, seed_of(None, salted["cache_salt"], bs))
            ev = b.events[0]
            assert [bmap.key_of(h) for h in ev.block_hashes] == full[: len(ev.block_hashes)]
        applied += 1

    for req in meta["requests"]:
        while applied < req["sub_before"]:
            apply_next()
        ids = req["prompt_token_ids"]
        keys = token_block_hashes(ids, bs, seed_of(None, req["cache_salt"] or "", bs))
        matched = index.match(keys, 0.0, count=False).blocks.get("w0", 0)
        # vLLM never counts the last prompt token as cached (it must compute its logits)
        predicted = min(matched, (len(ids) - 1) // bs) * bs
        assert predicted == req["cached_tokens"], req
    assert applied > salted_at
    while applied < len(payloads):
        apply_next()
    st = bmap.stats()
    assert st.removed_blocks > 0 and st.cleared == 1 and st.orphan_blocks == 0
    assert st.unknown_removed == 0 and st.mapped == 2  # the two blocks stored after reset


# ------------------------------------------------------------------ a fake engine


def index_keys(index, worker):
    return {k for k, n in index._nodes.items() if n.held_by(worker)}


def random_prompt(rng, prefixes):
    """A prompt sharing a random cached prefix, extended by random tokens."""
    if prefixes and rng.random() < 0.7:
        base = list(rng.choice(prefixes))
        base = base[: rng.randint(0, len(base))]
    else:
        base = []
    toks = base + [rng.randrange(50_000) for _ in range(rng.randint(1, 6 * BS))]
    prefixes.append(toks)
    if len(prefixes) > 40:
        prefixes.pop(0)
    return toks


# --------------------------------------------------------------- block map: units


def _apply(bmap, events, now=1.0):
    bmap.apply(decode_batch(batch(events)).events, now)
    bmap.index.check()
    bmap.check(exclusive=True)


def test_stored_chain_gets_the_keys_a_request_gets_and_repeats_are_idempotent():
    eng = FakeEngine()
    bmap, index = new_map()
    toks = list(range(100, 100 + 5 * BS + 2))
    _apply(bmap, eng.run(toks))
    keys = token_block_hashes(toks, BS, seed_of(None, "", BS))
    assert index.match(keys, 2.0).blocks == {"w0": 5}
    assert index_keys(index, "w0") == eng.truth() == set(keys)
    before = index.stats()
    ev = stored_map(list(eng.blocks)[:5], None, toks[: 5 * BS])  # vLLM "full" re-report
    _apply(bmap, [ev, ev], now=3.0)
    after = index.stats()
    assert (after.nodes, after.holder_entries) == (before.nodes, before.holder_entries)
    assert index_keys(index, "w0") == set(keys) and bmap.stats().stored_blocks == 15
    assert bmap.stats().remapped_blocks == 0


def test_consecutive_stores_of_one_chain_apply_like_one_by_one():
    """SGLang sends a page per event and vLLM a decode step's block per event; the map
    merges consecutive plain stores of one chain. Same result as one at a time."""
    toks = list(range(500, 500 + 6 * BS))
    h = [11, 12, 13, 14, 15, 16]
    evs = [stored_map(h[:2], None, toks[: 2 * BS], extra_keys=[None, None])]
    evs += [stored_map([h[i]], h[i - 1], toks[i * BS : (i + 1) * BS], extra_keys=[None]) for i in range(2, 5)]
    evs += [
        stored_tagged([h[5]], h[4], toks[5 * BS :], BS, None),  # SGLang-shaped
        stored_map([99], 12, range(BS)),  # a branch off block 1: not the chain's end
        removed_map([99]),
        stored_map([98], 16, range(BS)),
    ]
    merged, mi = new_map()
    _apply(merged, evs)
    single, si = new_map()
    for ev in evs:
        _apply(single, [ev])
    assert index_keys(mi, "w0") == index_keys(si, "w0")
    assert len(index_keys(mi, "w0")) == 7
    assert merged._keys == single._keys
    assert merged.stats() == single.stats()
    full = token_block_hashes(toks, BS, seed_of(None, "", BS))
    assert [merged.key_of(x) for x in h] == full


def test_removed_unknown_is_counted_and_ignored():
    eng = FakeEngine()
    bmap, index = new_map()
    _apply(bmap, eng.run(list(range(3 * BS))))
    _apply(bmap, [removed_map([12345, 678])])
    assert bmap.stats().unknown_removed == 2 and len(index_keys(index, "w0")) == 3


def test_orphans_of_a_late_join_are_dropped_until_the_chain_is_restored():
    eng = FakeEngine()
    bmap, index = new_map()
    toks = list(range(6 * BS))
    eng.run(toks[: 3 * BS])  # before we joined: never seen
    _apply(bmap, eng.run(toks))  # parent unknown: 3 orphans
    st = bmap.stats()
    assert st.orphan_blocks == 3 and st.mapped == 0 and not index_keys(index, "w0")
    # the engine re-reports the whole chain from the root (vLLM's "full" report mode)
    hashes = list(eng.blocks)
    _apply(bmap, [stored_map(hashes, None, toks)])
    assert index_keys(index, "w0") == eng.truth()


def test_parent_removed_before_child_drops_descendants_and_tolerates_stale_entries():
    eng = FakeEngine()
    bmap, index = new_map()
    toks = list(range(4 * BS))
    _apply(bmap, eng.run(toks))
    h = list(eng.blocks)
    _apply(bmap, [removed_map([h[1]])])  # vLLM evicted block 1; 2 and 3 stay cached
    assert index_keys(index, "w0") == {bmap.key_of(h[0])}
    assert len(bmap) == 3  # 2 and 3 still mapped (stale)
    # a child stored under the stale block 3 is refused by the index, counted
    _apply(bmap, [stored_map([999], h[3], range(7, 7 + BS))])
    assert bmap.stats().stale_parent_blocks == 1
    assert index_keys(index, "w0") == {bmap.key_of(h[0])}
    # the engine re-stores block 1 (recomputed): index holds 0, 1 again
    _apply(bmap, [stored_map([h[1]], h[0], toks[BS : 2 * BS])])
    assert index_keys(index, "w0") == {bmap.key_of(h[0]), bmap.key_of(h[1])}
    _apply(bmap, [removed_map([h[2], h[3], 999])])  # later removals of the stale ones
    assert len(bmap) == 2 and bmap.stats().unknown_removed == 0


def test_all_cleared_and_reset_clear_only_this_worker():
    eng0, eng1 = FakeEngine(seed=1), FakeEngine(seed=2)
    index = PrefixIndex()
    m0, _ = new_map("w0", index)
    m1, _ = new_map("w1", index)
    toks = list(range(3 * BS))
    _apply(m0, eng0.run(toks))
    _apply(m1, eng1.run(toks))
    assert len(index_keys(index, "w0")) == len(index_keys(index, "w1")) == 3
    _apply(m0, eng0.clear())
    assert not index_keys(index, "w0") and len(index_keys(index, "w1")) == 3
    assert m0.stats().cleared == 1 and len(m0) == 0
    m1.on_reset("restarted", 0)
    assert not index_keys(index, "w1")
    m1.check(exclusive=True)


def test_other_groups_and_unkeyable_blocks_are_left_out():
    bmap, index = new_map()
    t = list(range(2 * BS))
    _apply(
        bmap,
        [
            stored_map([1, 2], None, t, medium="CPU"),
            stored_map([1, 2], None, t, group_idx=1),
            stored_map([3], None, [], 0, medium="CPU"),
        ],
    )
    # another KV group: ignored; a CPU-tier chain with tokens: keyed into the CPU tier,
    # not the GPU tree; a CPU block without tokens whose hash was never mapped: dropped
    st = bmap.stats()
    assert st.other_tier_blocks == 2 and not index_keys(index, "w0")
    assert st.cold_stored_blocks == 2 and st.cold_unmapped_blocks == 1
    assert index.tier_entries("w0") == {"cpu": 2, "disk": 0}
    _apply(bmap, [removed_map([1], medium="CPU")])
    st = bmap.stats()
    assert st.cold_removed_blocks == 1 and st.unknown_removed == 0 and st.cold_mapped == 1
    assert index.tier_entries("w0") == {"cpu": 1, "disk": 0}
    bmap.check(exclusive=True)
    # a placeholder in the GPU tier (no tokens) and masked tokens: not keyable
    _apply(bmap, [stored_map([4], None, []), stored_map([5], None, range(3 * BS), group_idx=0)])
    assert bmap.stats().untokenized_blocks == 1 and bmap.stats().unaligned_blocks == 1
    # multimodal extra keys on block 1: block 0 indexed, 1 unkeyable, 2 orphaned
    _apply(bmap, [stored_map([6, 7, 8], None, range(3 * BS), extra_keys=[None, [["img-sha", 0]], None])])
    st = bmap.stats()
    assert st.unkeyable_blocks == 1 and st.orphan_blocks == 1 and len(index_keys(index, "w0")) == 1
    # an adapter given by id only cannot be named: unkeyable
    _apply(bmap, [stored_map([9], None, range(BS), lora_id=3)])
    assert bmap.stats().unkeyable_blocks == 2
    # another block size than the worker's key space
    _apply(bmap, [stored_map([10], None, range(8), 8)])
    assert bmap.stats().block_size_mismatch_blocks == 1


def test_lora_and_salt_extra_keys_seed_the_chain_like_a_request():
    bmap, index = new_map()
    t = list(range(2 * BS))
    _apply(
        bmap, [stored_map([1, 2], None, t, lora_name="ad", lora_id=1, extra_keys=[["ad", "tenant"], ["ad"]])]
    )
    want = token_block_hashes(t, BS, seed_of("ad", "tenant", BS))
    assert [bmap.key_of(1), bmap.key_of(2)] == want
    assert index.match(want, 1.0).blocks == {"w0": 2}
    plain = token_block_hashes(t, BS, seed_of(None, "", BS))
    assert index.match(plain, 1.0).blocks == {}


def test_block_size_learned_from_the_first_event():
    bmap, index = new_map(block_size=None)
    _apply(bmap, [stored_map([1], None, range(8), 8)])
    assert (
        bmap.block_size == 8
        and bmap.key_of(1) == token_block_hashes(list(range(8)), 8, seed_of(None, "", 8))[0]
    )


def test_remapped_engine_hash_replaces_the_old_key():
    bmap, index = new_map()
    _apply(bmap, [stored_map([1], None, range(BS))])
    old = bmap.key_of(1)
    _apply(bmap, [stored_map([1], None, range(5, 5 + BS))])
    assert bmap.stats().remapped_blocks == 1 and index_keys(index, "w0") == {bmap.key_of(1)} != {old}


def test_index_budget_eviction_leaves_stale_entries_that_stay_true():
    index = PrefixIndex(max_bytes=40 * 200)
    eng = FakeEngine(capacity=400)
    bmap, _ = new_map(index=index)
    rng = random.Random(3)
    prefixes = []
    for step in range(150):
        evs = eng.run(random_prompt(rng, prefixes))
        if evs:
            bmap.apply(decode_batch(eng.payload(evs)).events, float(step))
            index.check()
            bmap.check(exclusive=True)
            assert index_keys(index, "w0") <= eng.truth()  # never claims a missing block
    assert index.stats().evicted_entries > 0 and len(bmap) == len(eng.blocks)


@pytest.mark.parametrize("style", ["map", "tagged", "sglang"])
def test_stress_index_equals_engine_after_every_batch(style):
    for seed in range(3):
        rng = random.Random(seed)
        eng = FakeEngine(capacity=rng.choice([8, 24, 64]), seed=seed, style=style)
        bmap, index = new_map()
        prefixes = []
        for step in range(250):
            r = rng.random()
            if r < 0.02:
                evs = eng.clear()
            else:
                # SGLang's events carry no extra keys: no salted namespaces there
                salt = "" if style == "sglang" else rng.choice(["", "", "s1"])
                evs = eng.run(random_prompt(rng, prefixes), salt=salt)
            if not evs:
                continue
            bmap.apply(decode_batch(eng.payload(evs)).events, float(step))
            index.check()
            bmap.check(exclusive=True)
            assert index_keys(index, "w0") == eng.truth(), (seed, step)
            assert len(bmap) == len(eng.blocks)
        st = bmap.stats()
        assert st.orphan_blocks == st.unknown_removed == st.stale_parent_blocks == 0


# ------------------------------------------------------------------- endpoints


def test_subscriber_endpoint_follows_vllms_bind_rule():
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.7") == ("connect", "tcp://10.0.0.7:5557")
    assert subscriber_endpoint("tcp://[::]:5557", "::1") == ("connect", "tcp://[::1]:5557")
    assert subscriber_endpoint("ipc:///run/kv.sock") == ("connect", "ipc:///run/kv.sock")
    assert subscriber_endpoint("tcp://10.0.0.9:5557") == ("bind", "tcp://10.0.0.9:5557")
    assert subscriber_endpoint("tcp://*:5557", mode="bind") == ("bind", "tcp://*:5557")
    assert replace_wildcard("tcp://*:1", "h") == "tcp://h:1"
    assert replace_wildcard("tcp://a:1", "h") == "tcp://a:1"
    with pytest.raises(ValueError, match="engine_host"):
        subscriber_endpoint("tcp://*:5557")
    with pytest.raises(ValueError, match="tcp://"):
        subscriber_endpoint("http://x:1")
    sub = KvEventSubscriber.for_engine(
        "tcp://*:18501",
        None,
        engine_host="127.0.0.1",
        engine_replay_endpoint="tcp://*:18502",
        topic="kv-events",
    )
    assert (sub.mode, sub.endpoint, sub.replay_endpoint) == (
        "connect",
        "tcp://127.0.0.1:18501",
        "tcp://127.0.0.1:18502",
    )
    sub = KvEventSubscriber.for_engine("tcp://10.1.2.3:7000", None)
    assert (sub.mode, sub.endpoint, sub.replay_endpoint) == ("bind", "tcp://10.1.2.3:7000", None)
    with pytest.raises(ValueError, match="engine_host"):
        KvEventSubscriber.for_engine("ipc:///x", None, engine_replay_endpoint="tcp://*:1")


# ---------------------------------------------------------- live ZMQ, in-process


class FakePublisher:
    """vLLM's ``ZmqEventPublisher`` wire protocol on asyncio sockets: PUB (bind or
    connect), seq from ``seq_start``, a replay ROUTER with a ``buffer_steps`` deque
    answering ``[id, b"", start_seq]`` with ``[id, b"", topic, seq, payload]...`` and
    the end marker (``sglang=True``: SGLang's framing, no topic)."""

    def __init__(
        self,
        ctx,
        endpoint,
        *,
        bind=True,
        replay=None,
        topic=b"kv-events",
        buffer_steps=10_000,
        seq_start=0,
        sglang=False,
        replay_delay_s=0.0,
    ):
        self.ctx, self.endpoint, self.bind, self.replay_ep = ctx, endpoint, bind, replay
        self.replay_delay_s = replay_delay_s  # a busy engine answers its replay late
        self.topic, self.buffer_steps, self.seq, self.sglang = topic, buffer_steps, seq_start, sglang
        self.buffer = []
        self.replay_requests = 0
        self.pub = self.router = self.task = None

    async def start(self):
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.linger = 0
        if self.bind:
            self.pub.bind(self.endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.pub.connect(self.endpoint)
        if self.replay_ep:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.linger = 0
            self.router.bind(self.replay_ep)
            self.replay_ep = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.task = asyncio.create_task(self._serve())
        return self

    def publish(self, payload, deliver=True):
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        del self.buffer[: -self.buffer_steps]
        if deliver:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames):
        self.pub.send_multipart(frames)

    async def _serve(self):
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, sb = frames
            self.replay_requests += 1
            start = int.from_bytes(sb, "big")
            if self.replay_delay_s:
                await asyncio.sleep(self.replay_delay_s)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    head = [ident, b""] if self.sglang else [ident, b"", self.topic]
                    await self.router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
            tail = [ident, b"", END_SEQ, b""] if self.sglang else [ident, b"", b"", END_SEQ, b""]
            await self.router.send_multipart(tail)

    async def aclose(self):
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        for s in (self.pub, self.router):
            if s is not None:
                s.close(0)


class Recorder:
    """An EventConsumer that applies to a block map, checks after every batch, and
    records the calls in order."""

    def __init__(self, bmap, engine=None):
        self.bmap, self.engine = bmap, engine
        self.calls = []
        self.exact = True  # compare the index with the engine after each batch

    def on_batch(self, seq, b):
        self.calls.append(("batch", seq))
        self.bmap.on_batch(seq, b)
        self.bmap.index.check()
        self.bmap.check(exclusive=True)

    def on_gap(self, a, b):
        self.calls.append(("gap", a, b))
        self.bmap.on_gap(a, b)

    def on_reset(self, reason, seq):
        self.calls.append(("reset", reason, seq))
        self.bmap.on_reset(reason, seq)

    def on_error(self, cause, detail):
        self.calls.append(("error", cause.value))
        self.bmap.on_error(cause, detail)

    def on_synced(self, seq):
        self.calls.append(("synced", seq))
        self.bmap.on_synced(seq)

    def kinds(self, kind):
        return [c for c in self.calls if c[0] == kind]


async def wait_for(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def join(pub, sub, eng):
    """Publishes empty batches until the subscriber has seen one (PUB/SUB slow
    joiner: subscriptions propagate asynchronously)."""
    deadline = time.monotonic() + 5
    while sub.last_seq is None:
        assert time.monotonic() < deadline, "subscriber never joined"
        pub.publish(eng.payload([]))
        await asyncio.sleep(0.02)
    await wait_for(lambda: sub.last_seq == pub.seq - 1, what="join drained")


async def drive(pub, sub, rec, eng, rng, steps, prefixes, *, drop=()):
    """Runs ``steps`` engine steps through the publisher; after each, waits for the
    subscriber and (unless a gap is expected) compares the index with the engine.
    Returns how many batches were dropped (published to the replay buffer only)."""
    dropped = 0
    for step in range(steps):
        evs = eng.run(random_prompt(rng, prefixes))
        if not evs:
            continue
        seq = pub.publish(eng.payload(evs), deliver=step not in drop)
        if step in drop:
            dropped += 1
            continue
        await wait_for(lambda: sub.last_seq == seq, what=f"seq {seq}")
        if rec.exact:
            assert index_keys(rec.bmap.index, rec.bmap.worker) == eng.truth(), step
    return dropped


@pytest.fixture
def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.parametrize("transport", ["tcp-publisher-binds", "tcp-subscriber-binds", "ipc"])
async def test_live_stream_keeps_the_index_equal_to_the_engine(ctx, tmp_path, transport):
    eng = FakeEngine(capacity=32)
    bmap, index = new_map()
    rec = Recorder(bmap)
    if transport == "tcp-subscriber-binds":
        sub = KvEventSubscriber("tcp://127.0.0.1:0", rec, mode="bind", topic="kv-events")
        await sub.start()
        pub = await FakePublisher(ctx, sub.address, bind=False).start()
    else:
        ep = "tcp://127.0.0.1:0" if transport == "tcp-publisher-binds" else f"ipc://{tmp_path}/kv.sock"
        pub = await FakePublisher(ctx, ep).start()
        mode, addr = (
            subscriber_endpoint(pub.endpoint.replace("127.0.0.1", "*"), "127.0.0.1")
            if transport != "ipc"
            else subscriber_endpoint(pub.endpoint)
        )
        assert mode == "connect"
        sub = KvEventSubscriber(addr, rec, mode=mode, topic="kv-events")
        await sub.start()
    try:
        await join(pub, sub, eng)
        assert rec.calls[0][:2] == ("reset", "joined")
        await drive(pub, sub, rec, eng, random.Random(1), 120, [])
        seq = pub.publish(eng.payload(eng.clear()))
        await wait_for(lambda: sub.last_seq == seq)
        assert not index_keys(index, "w0")
        st = sub.stats()
        assert st.gaps == 0 and st.errors == {} and st.resets == {"joined": 1}
        assert st.connected and st.connections == 1
    finally:
        await sub.aclose()
        await sub.aclose()  # idempotent
        await pub.aclose()


async def test_gap_without_replay_drops_the_workers_entries_and_rebuilds(ctx):
    eng = FakeEngine(capacity=1000)
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0").start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events") as sub:
        await join(pub, sub, eng)
        rng, prefixes = random.Random(2), []
        await drive(pub, sub, rec, eng, rng, 20, prefixes)
        assert index_keys(index, "w0")
        rec.exact = False
        toks = list(range(7000, 7000 + 3 * BS))
        pub.publish(eng.payload(eng.run(toks)), deliver=False)  # lost on the wire
        seq = pub.publish(eng.payload(eng.run(toks + list(range(2 * BS)))))
        await wait_for(lambda: sub.last_seq == seq)
        assert rec.kinds("gap") == [("gap", seq - 1, seq)]
        # dropped, then rebuilt from what followed: the child chain is an orphan
        assert index_keys(index, "w0") == set()
        assert index_keys(index, "w0") <= eng.truth()
        assert bmap.stats().orphan_blocks == 2
        assert sub.stats().lost_batches == 1
    await pub.aclose()


async def test_gap_with_replay_is_filled_in_order_and_stays_exact(ctx):
    eng = FakeEngine(capacity=40)
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0").start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep) as sub:
        await join(pub, sub, eng)
        r0 = sub.stats().replayed  # the join replays what the slow joiner missed
        dropped = await drive(pub, sub, rec, eng, random.Random(3), 80, [], drop={10, 11, 12, 40})
        assert dropped == 4 and rec.kinds("gap") == [] and sub.stats().replayed - r0 == dropped
        seqs = [c[1] for c in rec.kinds("batch")]
        assert seqs == list(range(seqs[0], seqs[-1] + 1))  # in order, none twice
        assert index_keys(index, "w0") == eng.truth()
    await pub.aclose()


async def test_replay_buffer_too_short_reports_what_it_cannot_give(ctx):
    eng = FakeEngine(capacity=1000)
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", buffer_steps=2).start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep) as sub:
        await join(pub, sub, eng)
        rec.exact = False
        first = pub.seq
        for i in range(4):  # four lost batches; the buffer keeps the last two + the live one
            pub.publish(eng.payload(eng.run(list(range(i * 100, i * 100 + 2 * BS)))), deliver=False)
        seq = pub.publish(eng.payload(eng.run(list(range(900, 900 + 2 * BS)))))
        await wait_for(lambda: sub.last_seq == seq)
        assert rec.kinds("gap") == [("gap", first, first + 3)]
        assert [c[1] for c in rec.kinds("batch")][-2:] == [first + 3, seq]
        assert index_keys(index, "w0") <= eng.truth() and len(index_keys(index, "w0")) == 4
    await pub.aclose()


async def test_replay_endpoint_that_never_answers_is_bounded_and_reported(ctx):
    eng = FakeEngine()
    bmap, index = new_map()
    rec = Recorder(bmap)
    # batches 0..4 went out before we joined: the join asks the replay endpoint
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", seq_start=5).start()
    with __import__("socket").socket() as s:  # a port nobody serves
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    async with KvEventSubscriber(
        pub.endpoint, rec, topic="kv-events", replay_endpoint=dead, replay_timeout_s=0.3
    ) as sub:
        t0 = time.monotonic()
        await join(pub, sub, eng)  # the join's replay from 0 fails: no gap, an error
        assert time.monotonic() - t0 < 3
        assert ("error", "replay_failed") in rec.calls and not rec.kinds("gap")
        pub.publish(eng.payload([]), deliver=False)
        seq = pub.publish(eng.payload([]))
        await wait_for(lambda: sub.last_seq == seq)
        assert rec.kinds("gap") == [("gap", seq - 1, seq)]
        # asked at the connection's join (and again, backed off, while no live batch
        # came), at the first live batch, then for the gap
        assert sub.stats().errors["replay_failed"] >= 3
    await pub.aclose()


async def test_late_join_with_replay_rebuilds_the_engines_whole_history(ctx):
    eng = FakeEngine(capacity=30)
    rng, prefixes = random.Random(4), []
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0").start()
    for _ in range(60):  # published before anyone subscribed
        evs = eng.run(random_prompt(rng, prefixes))
        if evs:
            pub.publish(eng.payload(evs))
    bmap, index = new_map()
    index.insert("w0", [1, 2, 3], 0.0)  # a stale belief from before: must go
    rec = Recorder(bmap)
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep) as sub:
        await join(pub, sub, eng)
        assert rec.calls[0][:2] == ("reset", "joined")
        assert index_keys(index, "w0") == eng.truth() and eng.truth()
        await drive(pub, sub, rec, eng, rng, 30, prefixes)
        assert not rec.kinds("gap")
    await pub.aclose()


@pytest.mark.parametrize("history", [0, 40])
async def test_join_learns_an_idle_engines_history_before_any_live_batch(ctx, history):
    """An engine nobody sends requests to publishes nothing: the subscriber asks the
    replay endpoint as soon as it is connected, so the index holds what the engine
    holds (and is in sync, even with nothing) before the first request is routed —
    not only once that request's own events arrive."""
    eng = FakeEngine(capacity=30)
    rng, prefixes = random.Random(8), []
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0").start()
    for _ in range(history):  # published before anyone subscribed
        evs = eng.run(random_prompt(rng, prefixes))
        if evs:
            pub.publish(eng.payload(evs))
    bmap, index = new_map()
    rec = Recorder(bmap)
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep) as sub:
        await wait_for(lambda: rec.kinds("synced"), what="the join's replay")
        assert rec.calls[0][:2] == ("reset", "joined")
        assert rec.kinds("synced") == [("synced", pub.seq - 1)] and sub.history_known
        assert index_keys(index, "w0") == eng.truth()
        assert bool(eng.truth()) == bool(history)
        # what follows live is in order: no second reset, nothing twice
        await drive(pub, sub, rec, eng, rng, 10, prefixes)
        assert len(rec.kinds("reset")) == 1 and not rec.kinds("gap")
        seqs = [c[1] for c in rec.kinds("batch")]
        assert seqs == sorted(set(seqs))
    await pub.aclose()


async def test_a_join_whose_replay_times_out_is_tried_again_until_the_idle_engine_is_in_sync(ctx):
    """A busy engine answers its replay later than the subscriber waits. The engine
    then sits idle (no live batch to join on): the join is tried again, backed off
    and with a longer deadline, and the index learns the engine's history without a
    single request (before, it stayed out of sync until the engine's first batch)."""
    eng = FakeEngine(capacity=30)
    rng, prefixes = random.Random(9), []
    pub = await FakePublisher(
        ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", replay_delay_s=0.5
    ).start()
    for _ in range(20):  # published before anyone subscribed
        evs = eng.run(random_prompt(rng, prefixes))
        if evs:
            pub.publish(eng.payload(evs))
    bmap, index = new_map()
    rec = Recorder(bmap)
    async with KvEventSubscriber(
        pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep, replay_timeout_s=0.3
    ) as sub:
        await wait_for(lambda: rec.kinds("synced"), what="a retried join", timeout=15)
        assert sub.stats().errors["replay_failed"] >= 1  # the first try timed out
        assert pub.replay_requests >= 2
        assert rec.kinds("synced") == [("synced", pub.seq - 1)] and sub.history_known
        assert index_keys(index, "w0") == eng.truth() and eng.truth()
    await pub.aclose()


async def test_the_index_keeps_what_it_knew_while_a_joins_replay_is_under_way(ctx):
    """A busy engine answers the join's replay late. The worker's entries (here a
    pick-time hint for the request whose events reveal the join) must not be gone
    for the replay's round trip: a next turn routed meanwhile found its holder
    empty and went to the other worker. The reset and the history land together."""
    eng = FakeEngine(capacity=1000)
    toks = list(range(4 * BS))
    pub = await FakePublisher(
        ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", replay_delay_s=0.5
    ).start()
    pub.publish(eng.payload(eng.run(list(range(9000, 9000 + 2 * BS)))))  # earlier history
    bmap, index = new_map()
    rec = Recorder(bmap)
    index.insert("w0", [11, 12, 13], 0.0)  # the router's pick-time hint
    seen = []

    async def sample():
        while True:
            seen.append(len(index_keys(index, "w0")))
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    try:
        async with KvEventSubscriber(
            pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep
        ) as sub:
            deadline = time.monotonic() + 5
            while sub.last_seq is None:  # the hinted request's events, until one is seen
                assert time.monotonic() < deadline, "subscriber never joined"
                pub.publish(eng.payload(eng.run(toks)))
                await asyncio.sleep(0.02)
            await wait_for(lambda: sub.last_seq == pub.seq - 1, what="join drained")
            assert index_keys(index, "w0") == eng.truth()
    finally:
        sampler.cancel()
        await pub.aclose()
    assert len(seen) > 50 and min(seen) > 0, seen


async def test_late_join_without_replay_claims_only_what_follows(ctx):
    eng = FakeEngine(capacity=1000)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0").start()
    toks = list(range(5 * BS))
    pub.publish(eng.payload(eng.run(toks[: 3 * BS])))  # nobody listening: lost
    bmap, index = new_map()
    index.insert("w0", [1, 2, 3], 0.0)
    rec = Recorder(bmap)
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events") as sub:
        await join(pub, sub, eng)
        assert rec.calls[0][:2] == ("reset", "joined") and not index_keys(index, "w0")
        seq = pub.publish(eng.payload(eng.run(toks)))
        await wait_for(lambda: sub.last_seq == seq)
        assert bmap.stats().orphan_blocks == 2 and not index_keys(index, "w0")
        seq = pub.publish(eng.payload(eng.run(list(range(500, 500 + 2 * BS)))))
        await wait_for(lambda: sub.last_seq == seq)
        assert index_keys(index, "w0") == {bmap.key_of(h) for h in list(eng.blocks)[-2:]}
    await pub.aclose()


async def test_sequence_going_backwards_is_an_engine_restart(ctx):
    eng = FakeEngine(capacity=1000)
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", seq_start=500).start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events") as sub:
        await join(pub, sub, eng)
        await drive(pub, sub, rec, eng, random.Random(5), 10, [])
        assert index_keys(index, "w0")
        # the same PUB socket (no reconnection), a new process's numbering
        eng2 = FakeEngine(capacity=1000, seed=9)
        pub.seq = 0
        seq = pub.publish(eng2.payload(eng2.run(list(range(3 * BS)))))
        await wait_for(lambda: sub.last_seq == seq)
        assert rec.kinds("reset")[-1] == ("reset", "restarted", 0)
        assert index_keys(index, "w0") == eng2.truth()
    await pub.aclose()


async def test_reconnection_to_a_restarted_engine_resets_even_if_seq_is_higher(ctx):
    """A new engine process on the same port whose numbering happens to be past ours:
    the sequence alone cannot tell; the socket monitor's new handshake does."""
    eng = FakeEngine(capacity=1000)
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0").start()
    ep = pub.endpoint
    async with KvEventSubscriber(ep, rec, topic="kv-events") as sub:
        await join(pub, sub, eng)
        await drive(pub, sub, rec, eng, random.Random(6), 10, [])
        last = sub.last_seq
        await pub.aclose()
        await wait_for(lambda: not sub.connected, what="disconnect")
        eng2 = FakeEngine(capacity=1000, seed=7)
        pub = await FakePublisher(ctx, ep, seq_start=last + 50).start()
        await wait_for(lambda: sub.stats().connections == 2, timeout=10, what="reconnect")
        deadline = time.monotonic() + 5
        while not rec.kinds("reset")[1:]:
            assert time.monotonic() < deadline
            pub.publish(eng2.payload([]))
            await asyncio.sleep(0.02)
        assert rec.kinds("reset")[1][:2] == ("reset", "reconnected")
        seq = pub.publish(eng2.payload(eng2.run(list(range(4 * BS)))))
        await wait_for(lambda: sub.last_seq == seq)
        assert index_keys(index, "w0") == eng2.truth()
    await pub.aclose()


async def test_two_subscribers_on_one_publisher_see_one_truth(ctx):
    eng = FakeEngine(capacity=24)
    index_a, index_b = PrefixIndex(), PrefixIndex()  # two router replicas
    ma, _ = new_map(index=index_a)
    mb, _ = new_map(index=index_b)
    ra, rb = Recorder(ma), Recorder(mb)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0").start()
    async with (
        KvEventSubscriber(pub.endpoint, ra, topic="kv-events") as sa,
        KvEventSubscriber(pub.endpoint, rb, topic="kv-events") as sb,
    ):
        deadline = time.monotonic() + 5
        while sa.last_seq is None or sb.last_seq is None:
            assert time.monotonic() < deadline
            pub.publish(eng.payload([]))
            await asyncio.sleep(0.02)
        rng, prefixes = random.Random(7), []
        for _step in range(60):
            evs = eng.run(random_prompt(rng, prefixes))
            if evs:
                seq = pub.publish(eng.payload(evs))
                await wait_for(lambda: sa.last_seq == seq and sb.last_seq == seq)
                assert index_keys(index_a, "w0") == index_keys(index_b, "w0") == eng.truth()
    await pub.aclose()


async def test_malformed_frames_are_counted_and_never_stop_the_loop(ctx, caplog):
    eng = FakeEngine(capacity=1000)
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0").start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events") as sub:
        await join(pub, sub, eng)
        rec.exact = False
        s = pub.seq
        pub.send_raw([b"kv-events", s.to_bytes(8, "big")])  # 2 frames
        pub.send_raw([b"kv-events", b"\x01", b"x"])  # short seq
        pub.send_raw([b"kv-events-other", s.to_bytes(8, "big"), eng.payload([])])  # topic
        for _ in range(3):
            pub.send_raw([b"kv-events", b"\x00" * 9, b"x"])  # long seq, thrice
        seq = pub.publish(b"\xc1")  # not msgpack: a lost batch
        seq2 = pub.publish(batch([{"type": "BlockStored", "block_hashes": "x"}]))
        seq3 = pub.publish(batch([{"type": "Future"}, removed_map([1])]))
        seq4 = pub.publish(eng.payload(eng.run(list(range(2 * BS)))))
        await wait_for(lambda: sub.last_seq == seq4)
        errs = sub.stats().errors
        assert errs == {
            "bad_frames": 1,
            "bad_seq": 4,
            "bad_topic": 1,
            "not_msgpack": 1,
            "bad_field": 1,
            "unknown_type": 1,
        }
        assert rec.kinds("gap") == [("gap", seq, seq + 1), ("gap", seq2, seq2 + 1)]
        assert ("batch", seq3) in rec.calls and bmap.stats().unknown_removed == 1
        assert index_keys(index, "w0") == eng.truth()
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "bad_seq" in r.getMessage()]
        assert len(warned) == 1  # once per cause
    await pub.aclose()


async def test_a_consumer_that_raises_does_not_stop_delivery(ctx):
    eng = FakeEngine()

    class Flaky(Recorder):
        def on_batch(self, seq, b):
            super().on_batch(seq, b)
            if seq % 2:
                raise RuntimeError("bug")

    bmap, _ = new_map()
    rec = Flaky(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0").start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events") as sub:
        await join(pub, sub, eng)
        for _ in range(4):
            seq = pub.publish(eng.payload([]))
        await wait_for(lambda: sub.last_seq == seq)
        assert sub.stats().errors.get("consumer_error", 0) >= 2
    await pub.aclose()


async def test_sglang_stream_with_its_replay_framing(ctx):
    """SGLang: tagged arrays, one BlockStored per page, signed int64 hashes, batches
    without dp_rank, replay answers without the topic frame."""
    eng = FakeEngine(capacity=30, style="sglang")
    bmap, index = new_map()
    rec = Recorder(bmap)
    pub = await FakePublisher(ctx, "tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", sglang=True).start()
    async with KvEventSubscriber(pub.endpoint, rec, topic="kv-events", replay_endpoint=pub.replay_ep) as sub:
        await join(pub, sub, eng)
        r0 = sub.stats().replayed
        dropped = await drive(pub, sub, rec, eng, random.Random(8), 80, [], drop={5, 6, 7, 30})
        assert dropped >= 3 and not rec.kinds("gap") and sub.stats().replayed - r0 == dropped
        assert index_keys(index, "w0") == eng.truth()
        assert any(h >= 1 << 63 for h in bmap._keys)  # signed ones arrived normalised
    await pub.aclose()


async def test_lifecycle_misuse_raises_with_the_fix(ctx):
    bmap, _ = new_map()
    sub = KvEventSubscriber("tcp://127.0.0.1:0", Recorder(bmap), mode="bind")
    await sub.aclose()  # before start: fine
    with pytest.raises(RuntimeError, match="start\\(\\) is called once"):
        await sub.start()
    with pytest.raises(ValueError, match="subscriber_endpoint"):
        KvEventSubscriber("tcp://*:1", Recorder(bmap), mode="auto")
    taken = KvEventSubscriber("tcp://127.0.0.1:0", Recorder(bmap), mode="bind")
    await taken.start()
    clash = KvEventSubscriber(taken.address, Recorder(bmap), mode="bind")
    with pytest.raises(zmq.ZMQError):
        await clash.start()
    await clash.aclose()
    await taken.aclose()
