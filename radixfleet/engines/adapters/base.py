"""What every engine adapter answers (contract 7, docs/DESIGN.md): narrow, frozen, stateless.

An adapter is the one place an engine kind's facts live; ``EngineLink`` asks it and
branches on no kind itself. Four questions, one group of members each::

    cache truth   pushes, lists_event_sources, event_sources(), truth()
    load          metrics
    keys          engine_tokens, whole_block_hits, tokenizer_root()
    scheduling    priority(), pd_leg

An adapter holds no state (``__slots__ = ()``, one shared instance per kind in
``radixfleet.engines.adapters.ADAPTERS``): what a worker learns lives on its link. Its
methods do I/O only where they say so, each request bounded, and never raise for
what an engine answers: an unusable answer is a value (``SourcesProblem``,
``KeysProblem``).
"""

from __future__ import annotations

import enum
import logging
from abc import ABC
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

from radixfleet.common.background import Backoff
from radixfleet.engines.event_sources import EventSource, SourcesCause, SourcesProblem
from radixfleet.engines.kinds import WorkerKind
from radixfleet.engines.tokenizer_source import EngineRoot, KeysCause, KeysProblem

if TYPE_CHECKING:
    import aiohttp

    from radixfleet.engines.engine_metrics import MetricsKind

log = logging.getLogger("radixfleet.engines")
T = TypeVar("T")


class Truth(str, enum.Enum):
    """Where a worker's index entries come from (``EngineAdapter.truth``)."""

    AGENT = "agent"  # agent event pushes (radixfleet.index.feedback)
    EXACT = "exact"  # engine KV events, in sync
    APPROXIMATE = "approximate"  # hints aged at capacity + cached_tokens corrections


class PdLeg(str, enum.Enum):
    """How a disaggregated request's prefill leg is sent to a worker (radixfleet/route/pd.py)."""

    #: the prefill leg first, on the OpenAI API with ``kv_transfer_params``; its
    #: answer's params go to the decode leg (vLLM's NIXL/P2P connectors)
    KV_TRANSFER = "kv_transfer"
    #: both legs at once, paired by a ``bootstrap_room`` (SGLang's disaggregation)
    BOOTSTRAP = "bootstrap"


class EngineAdapter(ABC):
    """One engine kind's answers. Subclasses set every class attribute below and
    override a method only where their engine differs from the rule stated here."""

    __slots__ = ()

    #: the kind this adapter answers for (its key in ``ADAPTERS``)
    kind: ClassVar[WorkerKind]

    # ------------------------------------------------------------ cache truth

    #: the worker pushes its own exact cache events and load reports to the router
    #: (radixfleet.index.feedback): its link probes, keys, scrapes and follows nothing, its
    #: index entries are capped and corrected by nothing here, and its answers add
    #: no sample to the fleet's pooled prefill rate (it reports its own)
    pushes: ClassVar[bool] = False
    #: with no ``events:`` endpoint configured, the engine itself says where its KV
    #: events are published (``event_sources``); asked again after a restart or a
    #: rejected data-parallel rank. False: events only from the configuration
    lists_event_sources: ClassVar[bool] = False

    def truth(self, in_sync: bool) -> Truth:
        """What a worker's (or one rank's) entries are, its events ``in_sync`` or not:
        the agent's pushes; else the engine's events while they are in sync, the
        router's hints corrected by answers otherwise (the approximate mode)."""
        if self.pushes:
            return Truth.AGENT
        return Truth.EXACT if in_sync else Truth.APPROXIMATE

    async def event_sources(
        self, session: aiohttp.ClientSession, url: str
    ) -> tuple[EventSource, ...] | SourcesProblem:
        """Where the engine at ``url`` publishes its KV events, one source per
        data-parallel rank in rank order, or why not (``SourcesCause.UNREACHABLE``:
        ask again, ``ask_until_answered``). One bounded request. The rule: an engine
        that lists none (``lists_event_sources`` False) says so."""
        return SourcesProblem(SourcesCause.MISSING, f"a {self.kind.value} worker lists no event sources")

    # ------------------------------------------------------------------- load

    #: the family of Prometheus names its ``/metrics`` is read in
    #: (radixfleet.engines.engine_metrics); None: none is scraped, its load is its own
    #: reports (``pushes``) or the router's counts
    metrics: ClassVar[MetricsKind | None] = None

    # ------------------------------------------------------------------- keys

    #: requests may be keyed in its engine's own tokens through a tokenizer the
    #: router finds from the engine: one it names (``tokenizer_root``, with
    #: ``tokenizers.discover``) or its ``POST /tokenize`` (``tokenizers.
    #: engine_tokenize``), found again after a restart. False: routing bytes unless
    #: a tokenizer is configured
    engine_tokens: ClassVar[bool] = False
    #: its prefix-cache hits (``usage.prompt_tokens_details.cached_tokens``) are
    #: whole KV blocks below the last prompt token (radixfleet.engines.accuracy)
    whole_block_hits: ClassVar[bool] = False

    async def tokenizer_root(
        self, session: aiohttp.ClientSession, url: str, model: str
    ) -> EngineRoot | KeysProblem:
        """What the engine at ``url`` names as its tokenizer (``model``: the configured
        model, "" for any), or why not (``KeysCause.UNREACHABLE``: ask again). One
        bounded request. The rule: an engine that names none says so."""
        return KeysProblem(KeysCause.NO_ROOT, f"a {self.kind.value} worker names no tokenizer")

    # ------------------------------------------------------------- scheduling

    #: how its prefill leg of a disaggregated request is sent
    pd_leg: ClassVar[PdLeg] = PdLeg.KV_TRANSFER

    def priority(self, rank: int, classes: int) -> int:
        """The body ``priority`` for request class ``rank`` of ``classes``
        (0: most urgent) in the engine's own order. The rule: lower values are
        served first (vLLM's order), so the class rank itself."""
        return rank


async def ask_until_answered(
    ask: Callable[[], Awaitable[T]], alive: Callable[[], bool], worker: str
) -> T | None:
    """An adapter's one-request answer (``tokenizer_root``, ``event_sources``),
    asked again (backoff 0.5 s to 10 s) while it is a problem of cause
    ``unreachable`` and ``alive()``; one log line the first time. None: no longer
    alive."""
    backoff = Backoff(0.5, 10.0)
    said = False
    while alive():
        found = await ask()
        if not isinstance(found, KeysProblem | SourcesProblem) or found.cause.value != "unreachable":
            return found
        if not said:
            said = True
            log.info("worker %s: %s; asking again until it answers", worker, found.detail)
        await backoff.sleep()
    return None
