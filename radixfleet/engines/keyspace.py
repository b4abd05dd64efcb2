"""Key spaces (contract 8, docs/DESIGN.md): how a request becomes index keys for a given worker.

Two kinds of space share one index, which stores chained 64-bit keys and does not
care how they were made::

    ByteSpace(block_bytes)                  routing bytes cut into block_bytes blocks
                                            (radixfleet.keys, contract 1): agents,
                                            and engines keyed without a tokenizer
    TokenSpace(model, tokenizer, block)     the engine's own tokens (its tokenizer and
                                            chat template, or its /tokenize: router.
                                            engines.engine_keys) in its own KV blocks:
                                            the keys its KV events produce too

A worker's space is fixed by its kind and config (``radixfleet.engines.link``). A
request is keyed once per space in use among the routable workers, not once per
worker (``KeyedRequest``). Keys of different spaces never meet in the index (their
seeds differ), so each worker's match is read from its own space's keys.

Policies see one ``RouteRequest`` and one ``MatchResult``. With one space in use
(the usual fleet) they are that space's. With several, the *primary* space is the
one most routable workers use; another space's match is converted to primary
blocks through tokens (``floor(matched_tokens / primary.block_tokens)``), which is
exact when both count real tokens and an estimate against the byte space.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixfleet.keys import BYTES_PER_TOKEN, Endpoint, PrefixKey, WorkerId
from radixfleet.policies.base import MatchResult, RouteRequest


@dataclass(frozen=True, slots=True)
class SpaceKey:
    """One request keyed in one space."""

    hashes: Sequence[int]
    #: prompt tokens: exact in a token space, estimated (bytes / 4) in the byte space
    prompt_tokens: int
    #: tokens per block (estimated in the byte space)
    block_tokens: int
    #: True when prompt_tokens and blocks count the engine's real tokens
    exact: bool


class ByteSpace:
    """Routing-byte keys (contract 1). The key is the one ``serve`` already computed."""

    __slots__ = ("block_bytes", "id")

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.id: Hashable = ("bytes", block_bytes)

    def key(self, endpoint: Endpoint, body: dict, pk: PrefixKey) -> SpaceKey:
        return SpaceKey(pk.hashes, pk.prompt_tokens, self.block_bytes // BYTES_PER_TOKEN, False)

    def __repr__(self) -> str:
        return f"ByteSpace({self.block_bytes})"


class TokenSpace:
    """An engine's token blocks, keyed with its own tokenizer (radixfleet.engines.token_keys):
    the namespace is the served model, the request's ``cache_salt`` (vLLM puts it in a
    sequence's first block key), its LoRA adapter and the block size."""

    __slots__ = ("model", "keyer", "block_size", "id")

    def __init__(self, model: str, keyer, block_size: int) -> None:
        self.model = model  # the served model name: part of every seed
        self.keyer = keyer  # radixfleet.engines.token_keys.TokenKeyer
        self.block_size = block_size
        self.id: Hashable = ("tokens", model, keyer.source, block_size)

    def key(self, endpoint: Endpoint, body: dict, pk: PrefixKey) -> SpaceKey:
        """Raises ``MalformedRequest`` naming the field. A request the keyer has no
        ids for (unkeyed: media, embeddings, an engine that did not answer) counts
        its routing bytes' estimate of prompt tokens."""
        tk = self.keyer.key(endpoint, body, model=self.model, block_size=self.block_size, adapter=pk.adapter)
        return SpaceKey(tk.hashes, tk.prompt_tokens or pk.prompt_tokens, self.block_size, tk.exact)

    def __repr__(self) -> str:
        return f"TokenSpace({self.model!r}, {self.keyer.source!r}, {self.block_size})"


class KeyedRequest:
    """A request keyed in every space in use, and its merged match.

    ``route_request`` and ``match`` are what the policy sees (module docstring);
    ``key_for(space)`` and ``blocks_for(worker)`` are what the data plane needs
    after the pick (the hint insert, load in uncached tokens, accuracy)."""

    __slots__ = ("keys", "matches", "primary", "route_request", "match", "_space_of", "_ranks", "_tiers")

    def __init__(
        self,
        keys: dict,
        matches: dict,
        primary,
        route_request: RouteRequest,
        match: MatchResult,
        space_of: Mapping[str, Any],
        ranks: Mapping[str, Mapping[int, int]] | None = None,
        tiers: Mapping[str, dict[str, int]] | None = None,
    ) -> None:
        self.keys = keys  # space id -> SpaceKey
        self.matches = matches  # space id -> MatchResult of that space's keys
        self.primary = primary  # the space id the policy's view is in
        self.route_request = route_request
        self.match = match
        self._space_of = space_of  # worker id -> space
        #: worker -> {data-parallel rank: leading blocks it holds} (ranked workers only;
        #: their ``matches`` entries are the best rank's)
        self._ranks = ranks or {}
        #: index holder -> {colder tier: blocks extending its GPU prefix} in its own
        #: space (``PrefixIndex.match_tiers``; holders with an extension only)
        self._tiers = tiers or {}

    @classmethod
    def single(
        cls, space_id: Hashable, key: SpaceKey, route_request: RouteRequest, match: MatchResult
    ) -> KeyedRequest:
        """A request in one key space that every worker uses (the simulator's byte
        space): ``match`` is both that space's match and the policy's."""
        return cls({space_id: key}, {space_id: match}, space_id, route_request, match, _Everyone(space_id))

    def space(self, worker: str):
        return self._space_of[worker]

    def key_for(self, worker: str) -> SpaceKey:
        return self.keys[self._space_of[worker].id]

    def blocks_for(self, worker: str, rank: int | None = None) -> int:
        """Leading blocks ``worker`` (its data-parallel ``rank``, if given) holds in
        its own space."""
        if rank is not None:
            return self._ranks.get(worker, {}).get(rank, 0)
        return self.matches[self._space_of[worker].id].blocks.get(worker, 0)

    def held_tokens(self, worker: str) -> int:
        """The prompt's leading tokens ``worker`` holds, as the index says (whole
        blocks of its own space)."""
        return self.blocks_for(worker) * self.key_for(worker).block_tokens

    def colder_for(self, holder: str) -> dict[str, int] | None:
        """{colder tier: blocks} extending ``holder``'s GPU prefix (None: none)."""
        return self._tiers.get(holder)

    def rank_blocks(self, worker: str) -> Mapping[int, int] | None:
        """{rank: leading blocks} of a worker indexed per data-parallel rank (None:
        no rank holds any)."""
        return self._ranks.get(worker)


class _Everyone(Mapping):
    """worker -> the one space every worker uses (``KeyedRequest.single``)."""

    __slots__ = ("_space",)

    def __init__(self, space_id: Hashable) -> None:
        self._space = _Space(space_id)

    def __getitem__(self, worker: str) -> _Space:
        return self._space

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class _Space:
    id: Hashable


def merge_matches(
    primary: SpaceKey,
    primary_match: MatchResult,
    others: Sequence[tuple[SpaceKey, MatchResult, Sequence[WorkerId]]],
) -> MatchResult:
    """The primary space's match plus the other spaces' workers, converted to primary
    blocks through tokens (module docstring)."""
    if not others:
        return primary_match
    blocks = dict(primary_match.blocks)
    pbt = max(1, primary.block_tokens)
    for sk, m, workers in others:
        for w in workers:
            b = m.blocks.get(w, 0)
            if b:
                blocks[w] = (b * sk.block_tokens) // pbt
    return MatchResult(blocks, primary_match.depth, primary_match.rate, primary_match.private)
