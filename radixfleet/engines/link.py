"""One worker's engine side: its lifecycle, key space, cache truth and load (contract 7, docs/DESIGN.md).

An ``EngineLink`` is the narrow object the data plane and the pool ask about a
worker's engine. What differs by engine kind it asks the kind's adapter
(``adapter``, radixfleet.engines.adapters); it branches on no kind itself. Per worker::

    kind        agent | vllm | sglang | openai (configured, or probed at start)
    space       ByteSpace, or TokenSpace once the tokenizer is loaded and the engine's
                block size is known (config, /metrics' cache_config_info, or events)
    keys        its tokenizer, chosen and checked by radixfleet.engines.link_keys; again
                after a restart (``describe()["keys"]`` says which way and why)
    events      the worker's configured ``events:``, or else the sources its engine
                lists (``EngineAdapter.event_sources``; only tcp:// on the worker's
                own host); one subscriber per data-parallel rank
    ranks       a server with N >= 2 event sources has N prefix caches: each rank's
                entries are held under the *part* holder ``"<worker>#<rank>"``
                (``holder``), the policy sees the worker with its best rank's match,
                and the request goes to the rank ``pick_rank`` chooses
                (vLLM's ``X-data-parallel-rank``)
    truth       ``EngineAdapter.truth``: EXACT while every followed rank is in sync
                (radixfleet.engines.block_map), else APPROXIMATE (pick-time hints aged at
                the KV capacity, corrected by answers); AGENT: its own pushes
    load        the engine's /metrics (``EngineAdapter.metrics``) beside the router's
                own counts; prefill speed and tier prices learned from answers
                (``observe``: radixfleet.engines.answers)

Lifecycle (``LinkState``): NEW -> RUNNING (``start``: probe if the kind is ``auto``,
find and check the tokenizer, start the scraper and the event subscriber) -> CLOSED
(``aclose``, idempotent: the worker left the pool or the router stops). A failing
probe, tokenizer, scrape or event stream never fails the link: it degrades to the
approximate mode with the router's own counts, visibly (metric + one log line per
cause: ``radixfleet_engine_events_unavailable_total{cause}``). An engine that rejects a
rank (it restarted with fewer) drops the rank map; the sources are asked again. An
engine that restarted is asked for its tokenizer again and re-probed: keys that
changed (another model) move the worker's key space, its entries dropped, and its
events are followed afresh.

Only the event loop touches a link. The pool owns the ``Worker``; the link holds it
to read its id/url and to report load through the pool (``pool.report_load``). Of its
owner (``radixfleet.engines.manager.Engines``) a link uses only ``LinkHost``; what it
learns for the whole fleet it reports to the owner's ``FleetRates``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import TYPE_CHECKING, Any, Protocol

from radixfleet.common.background import Backoff
from radixfleet.config import WorkerSpec
from radixfleet.engines import answers, link_keys, link_view
from radixfleet.engines.accuracy import PredictionStats
from radixfleet.engines.adapters import EngineAdapter, Truth, adapter_for, ask_until_answered
from radixfleet.engines.capacity import LearnedCapacity
from radixfleet.engines.event_sources import EventSource, SourcesProblem, sources_problem
from radixfleet.engines.keyspace import ByteSpace, TokenSpace
from radixfleet.engines.kinds import WorkerKind, configured_kind, probe
from radixfleet.engines.prefill_rate import FleetRates, with_prior
from radixfleet.engines.queue_estimate import QueueEstimate
from radixfleet.engines.tier_price import TierPrices
from radixfleet.engines.tokenizer_source import KeysProblem
from radixfleet.route.core import Placement
from radixfleet.wire.errors import MissingExtra
from radixfleet.wire.extras import require

if TYPE_CHECKING:
    import aiohttp

    from radixfleet.engines.engine_metrics import MetricsScraper
    from radixfleet.fleet.pool import Pool, Worker
    from radixfleet.index.prefix_index import PrefixIndex

log = logging.getLogger("radixfleet.engines")


class LinkState(str, enum.Enum):
    NEW = "new"  # constructed, start() not called
    RUNNING = "running"  # probing / subscribed / scraping as configured
    CLOSED = "closed"  # stopped; the worker left the pool or the router stopped


class LinkHost(Protocol):
    """What a link may use of its owner (``Engines``), and nothing else of it: the
    owner alone changes these."""

    index: PrefixIndex  # its worker's entries: cleared, capped, corrected
    pool: Pool  # where it reports load and restarts (the pool owns the Worker)
    prom: Any  # radixfleet.engines.manager.EnginePrometheus
    session: aiohttp.ClientSession | None  # probes, /kv_event_sources
    byte_space: ByteSpace  # a new link's key space, until it has a token space
    rates: FleetRates  # what the fleet's links learn together: report each answer

    @property
    def learn_capacity(self) -> bool: ...  # index.learn_capacity
    @property
    def events_allowed(self) -> tuple: ...  # registration.allow's networks (event_sources)
    @property
    def tokenizers(self) -> Any: ...  # radixfleet.config.TokenizersConfig
    def resolve(self, spec: WorkerSpec, served: tuple[str, ...]) -> WorkerSpec: ...
    async def load_keyer(self, source: str, worker: str, chat_template: str = "") -> Any: ...
    async def discover_keyer(
        self, source: str, chat_template: str = "", *, download: bool = False
    ) -> Any: ...
    def engine_keyer(self, source: str, model: str) -> Any: ...
    def new_scraper(self, link: EngineLink) -> Any: ...
    def new_subscriber(
        self, link: EngineLink, source: EventSource | None = None, rank: int | None = None
    ) -> tuple: ...
    def spaces_changed(self) -> None: ...  # its key space changed
    def ranks_changed(self, link: EngineLink, n: int) -> None: ...  # its rank map did


class EngineLink:
    """One worker's engine side (module docstring)."""

    def __init__(self, worker: Worker, spec: WorkerSpec, engines: LinkHost) -> None:
        self.worker = worker
        self.spec = spec
        self.engines = engines
        self.state = LinkState.NEW
        self.kind: WorkerKind | None = configured_kind(spec.kind)  # None: auto, probed
        self.models: tuple[str, ...] = (spec.model,) if spec.model else ()
        self.space: ByteSpace | TokenSpace = engines.byte_space
        self.block_size: int | None = spec.block_size or None  # engine tokens per KV block
        self.keyer = None  # radixfleet.engines.token_keys.TokenKeyer, once loaded
        #: which way the worker is keyed and why (``describe()["keys"]``); only
        #: _find_keys changes it (None: not chosen yet)
        self.key_choice: link_keys.KeyChoice | None = None
        self.own_tokenizer = bool(spec.tokenizer)  # set in its own entry (not models:)
        self._rekey: asyncio.Task | None = None  # a restart's re-probe under way
        #: rank (None: the worker as one engine) -> (KvEventSubscriber, EngineBlockMap);
        #: only _follow_events / _stop_events change it
        self.streams: dict[int | None, tuple] = {}
        #: where the followed events came from: "config", "engine" (/kv_event_sources)
        self.events_source: str | None = None
        #: data-parallel ranks requests are sent to (0: the worker as one engine; else
        #: >= 2, set with the rank map by _follow_events, dropped by rank_rejected)
        self.ranks = 0
        self._rank_inflight: list[int] = []  # requests the router has on each rank
        self._rank_cursor = 0  # rotates ties between equally good ranks
        self._synced: set = set()  # ranks (keys of streams) whose events are in sync
        self._refollow: asyncio.Task | None = None  # a re-ask of the sources under way
        self._events_lock = asyncio.Lock()  # one (re)subscription at a time
        #: the lowest rank the engine refused since it last (re)started: sources that
        #: still list it contradict the engine and are not followed (no retry loop)
        self._refused_rank: int | None = None
        self.scraper: MetricsScraper | None = None
        self.model_mismatch = False  # it serves another model than the configured one
        self.capacity_tokens: int | None = spec.kv_capacity_tokens or None
        #: the index cap learned from answers (approximate mode; radixfleet.engines.capacity)
        self.learned: LearnedCapacity | None = None
        self.stats = PredictionStats()
        self.rate = with_prior(spec.prefill_tokens_per_s)
        #: what a colder-tier hit costs to load back, per tier (radixfleet.engines.tier_price)
        self.tier_prices = TierPrices()
        self._tier_ctr: dict = {}  # tier -> its radixfleet_tier_matched_tokens child
        self._last_metrics = None  # the previous /metrics reading (restart detection)
        self.queue = QueueEstimate()  # prices the engine's waiting queue
        self._tasks: set[asyncio.Task] = set()
        self._events_logged: set[str] = set()
        #: the bring-up (probe, tokenizer, scraper, event subscription) has finished,
        #: whatever its outcome (``settling``)
        self.brought_up = False

    # ------------------------------------------------------------------ queries

    @property
    def in_sync(self) -> bool:
        """Events flow, with no gap since the last reset, from every followed rank."""
        return bool(self._synced) and len(self._synced) >= len(self.streams)

    @property
    def subscriber(self):
        """The (first) rank's subscriber, or None: no events followed."""
        return next(iter(self.streams.values()))[0] if self.streams else None

    @property
    def block_map(self):
        return next(iter(self.streams.values()))[1] if self.streams else None

    def holder(self, rank: int | None) -> str:
        """The index holder of ``rank``'s entries: the worker's id, or its part."""
        wid = self.worker.id
        return wid if rank is None else f"{wid}#{rank}"

    def holders(self) -> list[str]:
        return [self.holder(r) for r in range(self.ranks)] if self.ranks else [self.worker.id]

    def pick_rank(self, blocks: dict | None) -> int | None:
        """The data-parallel rank a request chosen for this worker goes to (None: no
        rank map), counted as in flight there until ``rank_finished``: the rank
        holding most of its blocks (``blocks``: rank -> leading blocks held), ties
        to the rank with fewest router requests in flight, then in turn."""
        n = self.ranks
        if not n:
            return None
        best = max(blocks.values(), default=0) if blocks else 0
        inflight = self._rank_inflight
        c = self._rank_cursor
        r = min(
            (r for r in range(n) if (blocks.get(r, 0) if blocks else 0) == best),
            key=lambda r: (inflight[r], (r - c) % n),
        )
        self._rank_cursor = (r + 1) % n
        inflight[r] += 1
        return r

    def rank_finished(self, rank: int) -> None:
        if rank < len(self._rank_inflight) and self._rank_inflight[rank] > 0:
            self._rank_inflight[rank] -= 1

    @property
    def adapter(self) -> EngineAdapter:
        """What the worker's engine kind answers (radixfleet.engines.adapters); a kind not
        yet probed: the plain OpenAI server's."""
        return adapter_for(self.kind)

    @property
    def truth(self) -> Truth:
        return self.adapter.truth(self.in_sync)

    def colder_value(self, ext: dict, block_tokens: int, now: float) -> float:
        """GPU-hit-equivalent tokens of a colder extension ({tier: blocks}) on this
        worker: each tier's tokens times the share of a GPU hit its price leaves."""
        rate = self.prefill_rate(now)
        frac = self.tier_prices.fraction
        return sum(b * block_tokens * frac(t, rate) for t, b in ext.items())

    def count_match(self, gpu_blocks: int, ext: dict | None, block_tokens: int) -> None:
        """Counts a pick's matched tokens per tier (``radixfleet_tier_matched_tokens``)."""
        ctr = self._tier_ctr
        if gpu_blocks:
            c = ctr.get("gpu")
            if c is None:
                c = ctr["gpu"] = self.engines.prom.tier_matched.labels(self.worker.id, "gpu")
            c.inc(gpu_blocks * block_tokens)
        if ext:
            for t, b in ext.items():
                c = ctr.get(t)
                if c is None:
                    c = ctr[t] = self.engines.prom.tier_matched.labels(self.worker.id, t)
                c.inc(b * block_tokens)

    def tier_describe(self, now: float) -> dict:
        """Blocks per tier (GPU: the tree's entries) and each colder tier's price."""
        index = self.engines.index
        holders = self.holders()
        out: dict = {"gpu": {"blocks": sum(index.entries(h) for h in holders)}}
        prices = self.tier_prices.describe(self.prefill_rate(now))
        for h in holders:
            for t, n in index.tier_entries(h).items():
                out.setdefault(t, {"blocks": 0, **prices[t]})["blocks"] += n
        return out

    def describe(self) -> dict:
        """The ``/admin/workers`` view of this engine side (radixfleet.engines.link_view)."""
        return link_view.describe(self)

    def keys_describe(self) -> dict:
        """Which way the worker is keyed and why (radixfleet.engines.link_keys.describe)."""
        return link_keys.describe(self)

    @property
    def settling(self) -> bool:
        """Whether the engine side is still coming up: the bring-up (probe, tokenizer,
        event subscription) is under way, or a followed stream that can replay has
        not yet learned the engine's history (its join). A request routed meanwhile
        is keyed in bytes or finds none of what the engine holds — a conversation's
        next turn left the worker that held it. ``/readiness`` waits for it
        (``Engines.settling``)."""
        if self.state is not LinkState.RUNNING:
            return False
        if not self.brought_up:
            return True
        return any(
            sub.replay_endpoint is not None and not sub.history_known for sub, _ in self.streams.values()
        )

    def engine_load_fresh(self, now: float) -> bool:
        return self.scraper is not None and self.scraper.fresh(now) is not None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Probes (kind auto), then starts what the kind and config call for.
        Never raises for a worker's misbehaviour; refuses a second start."""
        if self.state is not LinkState.NEW:
            raise RuntimeError(f"EngineLink.start() in state {self.state.value}")
        self.state = LinkState.RUNNING
        self._spawn(self._run())

    async def aclose(self) -> None:
        """Stops the subscriber, scraper and probe. Idempotent."""
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._stop_events()
        if self.scraper is not None:
            await self.scraper.aclose()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _run(self) -> None:
        try:
            await self._bring_up()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a worker's engine side never takes the router down
            log.exception("worker %s: engine link failed; approximate mode, router counts", self.worker.id)
        finally:
            self.brought_up = True

    async def _bring_up(self) -> None:
        eng = self.engines
        backoff = Backoff(0.5, 10.0)
        while self.kind is None and self.state is LinkState.RUNNING:
            assert eng.session is not None, "the engines start their session before any link"
            res = await probe(eng.session, self.worker.url)
            if res is not None:
                self.kind = res.kind
                if not self.models and res.models:
                    self.models = res.models
                log.info(
                    "worker %s probed: %s, models %s",
                    self.worker.id,
                    res.kind.value,
                    ", ".join(self.models) or "?",
                )
                break
            await backoff.sleep()
        if self.state is not LinkState.RUNNING:
            return
        if self.adapter.pushes:
            return  # agents push events and load to the router (radixfleet.index.feedback)
        if not self.models:
            assert eng.session is not None, "the engines start their session before any link"
            res = await probe(eng.session, self.worker.url)
            if res is not None and res.models:
                self.models = res.models
        self._resolve_settings()
        if self.spec.model and self.models and self.spec.model not in self.models:
            # its tokenizer, block keys and events would describe another model
            self.model_mismatch = True
            eng.prom.model_mismatch.labels(self.worker.id).inc()
            log.error(
                "worker %s serves %s, not the configured model %r: keyed on routing "
                "bytes, its events ignored (approximate mode)",
                self.worker.id,
                ", ".join(self.models),
                self.spec.model,
            )
        else:
            await self._find_keys()
            if self.state is not LinkState.RUNNING:
                return
        if self.adapter.metrics is not None and self.spec.metrics.path:
            self.scraper = scraper = eng.new_scraper(self)
            await scraper.start()
        self._maybe_token_space()
        # The index ages this worker at its KV capacity in whatever space it is keyed
        # in: a worker that stays on routing bytes (no tokenizer, another model) with
        # its capacity from the YAML was never capped — its guesses grew past what the
        # engine holds and every correction was undone by the next hint.
        self._apply_capacity()
        if not self.model_mismatch:
            async with self._events_lock:
                await self._follow_events()

    def _resolve_settings(self) -> None:
        """Once the served models are known: the engine settings ``models:`` gives
        them fill what the worker's own entry leaves unset (Engines.resolve)."""
        spec = self.engines.resolve(self.spec, self.models)
        if spec == self.spec:
            return
        self.spec = spec
        self.block_size = self.block_size or spec.block_size or None
        self.capacity_tokens = self.capacity_tokens or spec.kv_capacity_tokens or None

    # ------------------------------------------------------------- key space

    @property
    def keys_problem(self) -> KeysProblem | None:
        """Why no tokenizer is loaded here (None: one is, or not chosen yet)."""
        return None if self.key_choice is None else self.key_choice.problem

    @property
    def served_model(self) -> str:
        """The model name the worker's keys and events are namespaced by."""
        return self.spec.model or (self.models[0] if self.models else "")

    async def _find_keys(self) -> bool:
        """Chooses the worker's keys (radixfleet.engines.link_keys) and moves its key
        space. True when the space changed."""
        choice = await link_keys.choose_keys(self, self._running)
        if choice is None:
            self.key_choice = None  # closed meanwhile
            return False
        self.key_choice = choice
        if choice.root is not None and choice.root.models and not self.spec.model:
            self.models = choice.root.models
        changed = self._use_keys(choice.keyer)
        link_keys.log_choice(self, choice)
        return changed

    def _running(self) -> bool:
        return self.state is LinkState.RUNNING

    def _use_keys(self, keyer) -> bool:
        """Keys the worker with ``keyer`` from now on (None: routing bytes); its
        entries of another space go. True when the key space changed."""
        old = self.space.id
        self.keyer = keyer
        if keyer is None and isinstance(self.space, TokenSpace):
            self.space = self.engines.byte_space
            for h in self.holders():
                self.engines.index.drop_worker(h)
            self._apply_capacity()
            self.engines.spaces_changed()
        elif keyer is not None:
            self._maybe_token_space()
        return self.space.id != old

    def _maybe_token_space(self) -> None:
        """Moves to the engine's token space once tokenizer and block size are known
        (or to another token space: a new tokenizer, another served model). The
        worker's entries of the old space can never match again: they are dropped."""
        if self.keyer is None or not self.block_size:
            return
        model = self.served_model
        sp = self.space
        if (
            isinstance(sp, TokenSpace)
            and sp.keyer is self.keyer
            and sp.model == model
            and sp.block_size == self.block_size
        ):
            return
        self.space = TokenSpace(model, self.keyer, self.block_size)
        self.stats.block_tokens = self.block_size
        for h in self.holders():
            self.engines.index.drop_worker(h)
        self._apply_capacity()
        self.engines.spaces_changed()
        log.info("worker %s keyed in %r", self.worker.id, self.space)

    def learn_block_size(self, block_size: int) -> None:
        """The engine's KV block size, from its metrics or its events."""
        if not self.block_size:
            self.block_size = block_size
            self._maybe_token_space()

    def _apply_capacity(self) -> None:
        """The approximate index ages this worker at its engine's KV capacity."""
        cap = self.capacity_tokens
        if cap is None or self.adapter.pushes:
            return
        if isinstance(self.space, TokenSpace):
            assert self.block_size is not None, "a token space is entered with a block size"
            bt = self.block_size
        else:
            bt = self.space.block_bytes // 4
        # a data-parallel server's capacity is its ranks' together (vLLM sums
        # num_gpu_blocks over them): each rank holds its share
        blocks = max(1, cap // max(1, bt) // max(1, self.ranks))
        if self.engines.learn_capacity:
            if self.learned is None or self.learned.configured != blocks:
                self.learned = LearnedCapacity(blocks)  # a new capacity: learn it afresh
            blocks = self.learned.blocks
        for h in self.holders():
            self.engines.index.set_capacity(h, blocks)

    # --------------------------------------------------------- engine metrics

    def on_metrics(self, m, now: float) -> None:
        """A fresh /metrics reading (radixfleet.engines.engine_metrics.MetricsConsumer)."""
        eng = self.engines
        if self._last_metrics is not None and m.restarted_since(self._last_metrics):
            self.engine_restarted("metrics: process start time changed")
        self._last_metrics = m
        if m.block_size and not self.block_size:
            self.learn_block_size(m.block_size)
        if (
            m.kv_capacity_tokens
            and not self.spec.kv_capacity_tokens
            and m.kv_capacity_tokens != self.capacity_tokens
        ):
            self.capacity_tokens = m.kv_capacity_tokens
            self._apply_capacity()
        cap = self.capacity_tokens or 0
        # The engine counts waiting requests, not their tokens nor their wait:
        # radixfleet.engines.queue_estimate prices them (the fleet's mean uncached
        # prompt, the engine's own, and its departure rate, whichever is larger).
        self.queue.observe(
            now, m.waiting_requests, m.prefilled_requests, m.prefix_queries_tokens, m.prefix_hits_tokens
        )
        rate = self.prefill_rate(now)
        queued = self.queue.queued_tokens(m.waiting_requests, eng.rates.mean_request_tokens, rate)
        load = m.load(queued, rate, cap)
        eng.pool.report_load(
            self.worker, load, now, stale_s=self.scraper.stale_after_s if self.scraper else None, engine=True
        )
        eng.prom.scrape_ok(self.worker.id)

    def on_failure(self, cause, detail: str) -> None:
        self.engines.prom.scrape_failed(self.worker.id, getattr(cause, "value", str(cause)))

    # ------------------------------------------------------------ KV events

    async def _follow_events(self) -> None:
        """Subscribes to the engine's KV events: the configured ``events:`` if any,
        else (vLLM) every rank ``/kv_event_sources`` lists, asked again while the
        server does not answer. Sets the rank map (two ranks or more). Never raises
        for what the engine says or does: no usable events is the approximate mode,
        visibly (``_no_events``)."""
        spec = self.spec.events
        if spec.mode == "off":
            return
        if spec.endpoint:
            sources: tuple = (None,)  # the configured endpoint: one stream, no ranks
            origin = "config"
        elif self.adapter.lists_event_sources:
            session, url = self.engines.session, self.worker.url
            assert session is not None, "the engines start their session before any link"
            found = await ask_until_answered(
                lambda: self.adapter.event_sources(session, url), self._running, self.worker.id
            )
            if found is None:
                return  # closed meanwhile
            if not isinstance(found, SourcesProblem):
                # the worker names these: only its own host (or registration.allow)
                found = sources_problem(found, _host(url), self.engines.events_allowed) or found
            if isinstance(found, SourcesProblem):
                self._set_ranks(0)
                self._no_events(found.cause.value, found.detail)
                return
            if self._refused_rank is not None and len(found) > self._refused_rank:
                self._set_ranks(0)
                self._no_events(
                    "malformed",
                    f"it lists rank {self._refused_rank}, which it refused; not followed until it restarts",
                )
                return
            sources, origin = found, "engine"
            self._set_ranks(len(found) if len(found) >= 2 else 0)
        else:
            return
        if self.keyer is None:
            why = self.keys_problem
            self._no_events(
                "no_tokenizer",
                "events name token blocks and the worker has no tokenizer"
                + (f" ({why.cause.value}, above)" if why is not None else "")
                + "; set one to key requests in its tokens",
            )
            return
        try:  # the engines extra: ZMQ and msgpack (radixfleet.engines.zmq_events)
            zmq = require("zmq", "engines", "following an engine's KV-cache events")
            require("msgpack", "engines", "following an engine's KV-cache events")
        except MissingExtra as exc:
            self._no_events("missing_extra", str(exc))
            return
        streams = {}
        for src in sources:
            rank = None if src is None or not self.ranks else src.rank
            try:
                sub, bmap = self.engines.new_subscriber(self, src, rank)
                streams[rank] = (sub, bmap)
                await sub.start()
            except (zmq.ZMQError, ValueError) as exc:
                for s, _ in streams.values():
                    await s.aclose()
                self._endpoint_refused(src, exc)
                return
        self.streams = streams
        self.events_source = origin
        self.engines.prom.events_followed(self.worker.id, origin, len(streams))
        log.info(
            "worker %s: following its KV events (%s): %s",
            self.worker.id,
            origin,
            ", ".join(sub.address or "?" for sub, _ in streams.values()),
        )

    def _no_events(self, cause: str, detail: str) -> None:
        self.engines.prom.events_unavailable(self.worker.id, cause)
        log.warning(
            "worker %s: no KV events to follow (%s: %s): approximate mode (the "
            "router's own hints, corrected by each answer's cached tokens)",
            self.worker.id,
            cause,
            detail,
        )

    def _endpoint_refused(self, src: EventSource | None, exc: Exception) -> None:
        """An events endpoint the router cannot use: one clear line saying which side
        binds and what to write; the worker keeps serving in the approximate mode."""
        from radixfleet.engines.zmq_events import refusal  # a subscriber was made: the extra is here

        ev = self.spec.events
        endpoint, mode = (ev.endpoint, ev.mode) if src is None else (src.endpoint, "auto")
        cause, fix = refusal(endpoint, _host(self.worker.url), mode, exc)
        self.engines.prom.events_unavailable(self.worker.id, cause)
        log.error("worker %s: KV events not followed (%s): %s; approximate mode", self.worker.id, exc, fix)

    async def _stop_events(self) -> None:
        streams, self.streams = self.streams, {}
        self._synced.clear()
        if self.events_source is not None and self.state is not LinkState.CLOSED:
            # (a closed link's worker left: its series are forgotten, not zeroed)
            self.engines.prom.events_followed(self.worker.id, self.events_source, 0)
        self.events_source = None
        for sub, bmap in streams.values():
            await sub.aclose()
            bmap.reset()  # its entries are no longer followed

    def _set_ranks(self, n: int) -> None:
        """The rank map: ``n`` data-parallel ranks (0: none). The worker's entries are
        dropped: they were held under the old holders."""
        if n == self.ranks:
            return
        self._drop_entries()
        self.engines.index.drop_worker(self.worker.id)  # and every rank part
        self.ranks = n
        self._rank_inflight = [0] * n
        self._rank_cursor = 0
        self.engines.ranks_changed(self, n)
        self._apply_capacity()
        if n:
            log.info(
                "worker %s: %d data-parallel ranks, each indexed and routed to on "
                "its own (X-data-parallel-rank)",
                self.worker.id,
                n,
            )

    def rank_rejected(self, rank: int, detail: str) -> None:
        """The engine refused ``rank`` (it restarted with fewer ranks): the rank map
        and the streams go; the sources are asked again (once at a time)."""
        if not self.ranks:
            return
        self.engines.prom.events_unavailable(self.worker.id, "rank_rejected")
        if self._refused_rank is None or rank < self._refused_rank:
            self._refused_rank = rank
        log.warning(
            "worker %s rejected data-parallel rank %d (%s): its rank map is dropped "
            "and its event sources asked again",
            self.worker.id,
            rank,
            detail[:200],
        )
        self._set_ranks(0)
        self._refollow_events()

    def _refollow_events(self) -> None:
        """Asks a vLLM server for its event sources again (a restart, a rejected
        rank), unless the worker's events are configured or off."""
        if (
            self.state is not LinkState.RUNNING
            or not self.adapter.lists_event_sources
            or self.spec.events.endpoint
            or self.spec.events.mode == "off"
            or self.model_mismatch
        ):
            return
        if self._refollow is not None and not self._refollow.done():
            return

        async def again():
            async with self._events_lock:
                await self._stop_events()
                await self._follow_events()

        self._refollow = self._spawn(self._guarded(again()))

    async def _guarded(self, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a worker's engine side never takes the router down
            log.exception("worker %s: following KV events failed; approximate mode", self.worker.id)

    def events_synced(self, rank: int | None = None) -> None:
        if rank in self._synced:
            return
        self._synced.add(rank)
        if self.in_sync:
            log.info("worker %s: KV events in sync (exact index)", self.worker.id)
            if self.learned is not None and self.learned.blocks != self.learned.configured:
                # the engine's events say what it holds now: a cap learned while the
                # index guessed must not evict what they report
                self.learned.blocks = self.learned.configured
                for h in self.holders():
                    self.engines.index.set_capacity(h, self.learned.blocks)

    def events_lost(self, reason: str, rank: int | None = None) -> None:
        """A gap that replay could not fill, a late join or a reset: the rank's
        entries are dropped and rebuilt from the events that follow."""
        st = self.streams.get(rank)
        if st is not None:
            st[1].reset()  # clears its index entries too
        else:
            self._drop_entries()
        self._synced.discard(rank)
        self.engines.prom.resync(self.worker.id, reason.split(" ")[0])
        if reason not in self._events_logged:
            self._events_logged.add(reason)
            log.warning(
                "worker %s: KV events %s%s: its index entries were dropped and are "
                "rebuilt from the events that follow",
                self.worker.id,
                reason,
                "" if rank is None else f" (rank {rank})",
            )

    def engine_restarted(self, why: str) -> None:
        """A new engine process: its cache is empty. Event sources the engine named
        are asked again (its data-parallel size may have changed)."""
        self.queue.reset()
        self.engines.pool.engine_restarted(self.worker)
        self._drop_entries()
        self._refused_rank = None  # a new process: what it lists is news
        self.engines.prom.resync(self.worker.id, "restart")
        log.warning("worker %s restarted (%s): its index entries were dropped", self.worker.id, why)
        if self._rekeys():
            self._rekey = self._spawn(self._guarded(self._rekey_then_follow()))
        else:
            self._refollow_events()

    def _rekeys(self) -> bool:
        """Whether a restart asks for the keys again: a vLLM/SGLang worker with a
        tokenizer set, or one its engine may name or tokenize for (not while a re-ask is
        under way)."""
        if self.state is not LinkState.RUNNING or not self.adapter.engine_tokens or self.model_mismatch:
            return False
        if self._rekey is not None and not self._rekey.done():
            return False
        t = self.engines.tokenizers
        return bool(self.spec.tokenizer) or t.discover or t.engine_tokenize

    async def _rekey_then_follow(self) -> None:
        """A restarted engine's keys, found and probed again; keys that changed (another
        model, another tokenizer, none) restart its event streams in the new space."""
        async with self._events_lock:
            changed = await self._find_keys()
            if changed and self.state is LinkState.RUNNING:
                if self.spec.events.mode != "off":
                    await self._stop_events()
                    await self._follow_events()
                return
        self._refollow_events()

    def _drop_entries(self) -> None:
        for _, bmap in self.streams.values():
            bmap.reset()  # clears its holder's index entries too
        for h in self.holders():
            self.engines.index.clear(h)
            self.engines.index.clear_tiers(h)  # the process's offloaded copies too

    # ------------------------------------------------------------- responses

    def observe(
        self, pick: Placement, usage: tuple[int, int] | None, ttft_s: float | None, now: float
    ) -> None:
        """One finished request on this worker: what it teaches (radixfleet.engines.answers)."""
        answers.learn(self, pick, usage, ttft_s, now)

    def rank_truth(self, rank: int) -> Truth:
        """What data-parallel ``rank``'s own entries are: its events in sync, or not."""
        return self.adapter.truth(rank in self._synced)

    def prefill_rate(self, now: float) -> float:
        """Prefill tokens/s the policy should assume: this worker's learned rate,
        shrunk toward the fleet's (``PrefillRateEstimator.blended``)."""
        return self.engines.rates.blended(self.rate, now)

    @property
    def corrects(self) -> bool:
        """Whether responses correct this worker's entries (the approximate mode)."""
        return self.truth is Truth.APPROXIMATE


def _host(url: str) -> str | None:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname
