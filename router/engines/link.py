"""One worker's engine side: its kind, key space, cache truth and load (contract 7).

An ``EngineLink`` is the narrow object the data plane and the pool ask about a
worker's engine. Per worker::

    kind        agent | vllm | sglang | openai (configured, or probed at start)
    space       ByteSpace, or TokenSpace once the tokenizer is loaded and the engine's
                block size is known (config, /metrics' cache_config_info, or events)
    truth       EXACT: KV events subscribed and in sync; the worker's index entries
                are the engine's blocks (router.engines.block_map)
                APPROXIMATE: no events (or out of sync): the router's own pick-time
                hints, aged as an LRU at the engine's KV capacity and corrected by
                each response's reported cached tokens
                AGENT: our agent pushes exact events over HTTP (router.feedback)
    load        the engine's /metrics (waiting/running requests, KV usage) beside the
                router's own pick-time counts; prefill speed learned per worker from
                its responses (router.engines.prefill_rate)
    accuracy    predicted matched tokens vs reported cached tokens (accuracy.py)

Lifecycle (``LinkState``): NEW -> RUNNING (``start``: probe if the kind is ``auto``,
load the tokenizer, start the scraper and the event subscriber) -> CLOSED
(``aclose``, idempotent: the worker left the pool or the router stops). A failing
probe, tokenizer, scrape or event stream never fails the link: it degrades to the
approximate mode with the router's own counts, visibly (metric + one log line per
cause).

Only the event loop touches a link. The pool owns the ``Worker``; the link holds it
to read its id/url and to report load through the pool (``pool.report_load``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from typing import TYPE_CHECKING

from router.config import WorkerSpec
from router.engines.capacity import LearnedCapacity, correct
from router.engines.accuracy import PredictionStats, predicted_tokens
from router.engines.kinds import ENGINE_KINDS, WorkerKind, probe
from router.engines.keyspace import ByteSpace, SpaceKey, TokenSpace
from router.engines.queue_estimate import QueueEstimate
from protocol.events import MAX_LOAD_COUNT, Load

if TYPE_CHECKING:
    from router.engines.manager import Engines
    from router.pool import Worker

log = logging.getLogger("radixfleet.engines")


class LinkState(str, enum.Enum):
    NEW = "new"  # constructed, start() not called
    RUNNING = "running"  # probing / subscribed / scraping as configured
    CLOSED = "closed"  # stopped; the worker left the pool or the router stopped


class Truth(str, enum.Enum):
    AGENT = "agent"  # agent event pushes (router.feedback)
    EXACT = "exact"  # engine KV events, in sync
    APPROXIMATE = "approximate"  # hints aged at capacity + cached_tokens corrections


class EngineLink:
    """One worker's engine side (module docstring)."""

    def __init__(self, worker: "Worker", spec: WorkerSpec, engines: "Engines") -> None:
        self.worker = worker
        self.spec = spec
        self.engines = engines
        self.state = LinkState.NEW
        self.kind: WorkerKind | None = None if spec.kind == "auto" else WorkerKind(spec.kind)
        self.models: tuple[str, ...] = (spec.model,) if spec.model else ()
        self.space: ByteSpace | TokenSpace = engines.byte_space
        self.block_size: int | None = spec.block_size or None  # engine tokens per KV block
        self.keyer = None  # router.engines.token_keys.TokenKeyer, once loaded
        self.subscriber = None  # router.engines.zmq_events.KvEventSubscriber
        self.block_map = None  # router.engines.block_map.EngineBlockMap
        self.scraper = None  # router.engines.engine_metrics.MetricsScraper
        self.in_sync = False  # events flowing with no gap since the last reset
        self.model_mismatch = False  # it serves another model than the configured one
        self.capacity_tokens: int | None = spec.kv_capacity_tokens or None
        #: the index cap learned from answers (approximate mode; router.engines.capacity)
        self.learned: LearnedCapacity | None = None
        self.stats = PredictionStats()
        self.rate = engines.new_rate_estimator(spec.prefill_tokens_per_s)
        self._last_metrics = None  # the previous /metrics reading (restart detection)
        self.queue = QueueEstimate()  # prices the engine's waiting queue
        self._tasks: set[asyncio.Task] = set()
        self._events_logged: set[str] = set()

    # ------------------------------------------------------------------ queries

    @property
    def truth(self) -> Truth:
        if self.kind is WorkerKind.AGENT:
            return Truth.AGENT
        return Truth.EXACT if self.in_sync else Truth.APPROXIMATE

    @property
    def engine_blocks(self) -> bool:
        """Whether prefix hits are whole blocks below the last prompt token."""
        return self.kind in ENGINE_KINDS

    def describe(self) -> dict:
        acc = self.stats.summary().to_json()
        return {
            "kind": self.kind.value if self.kind else None,
            "truth": self.truth.value,
            "key_space": repr(self.space),
            "models": list(self.models),
            "block_size": self.block_size,
            "kv_capacity_tokens": self.capacity_tokens,
            "index_cap_blocks": None if self.learned is None else self.learned.blocks,
            "prefill_tokens_per_s": round(self.prefill_rate(time.monotonic()), 1),
            "prefill_tokens_per_s_own": round(self.rate.tokens_per_s, 1),
            "load_source": "engine" if self.engine_load_fresh(time.monotonic())
            else "router",
            "engine_queue": {
                "tokens_per_request": round(self.queue.tokens_per_request, 1),
                "departures_per_s": None if self.queue.departures_per_s is None
                else round(self.queue.departures_per_s, 2)},
            "events": None if self.subscriber is None else {
                "endpoint": self.spec.events.endpoint, "in_sync": self.in_sync,
                "connected": self.subscriber.connected,
                **(dataclasses.asdict(self.block_map.stats()) if self.block_map is not None
                   else {})},
            "prediction": acc,
        }

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
        for part in (self.subscriber, self.scraper):
            if part is not None:
                await part.aclose()

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
            log.exception("worker %s: engine link failed; approximate mode, router counts",
                          self.worker.id)

    async def _bring_up(self) -> None:
        eng = self.engines
        delay = 0.5
        while self.kind is None and self.state is LinkState.RUNNING:
            res = await probe(eng.session, self.worker.url)
            if res is not None:
                self.kind = res.kind
                if not self.models and res.models:
                    self.models = res.models
                log.info("worker %s probed: %s, models %s", self.worker.id, res.kind.value,
                         ", ".join(self.models) or "?")
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        if self.state is not LinkState.RUNNING:
            return
        if not self.models and self.kind is not WorkerKind.AGENT:
            res = await probe(eng.session, self.worker.url)
            if res is not None and res.models:
                self.models = res.models
        if self.kind is WorkerKind.AGENT:
            return  # agents push events and load to the router (router.feedback)
        if self.spec.model and self.models and self.spec.model not in self.models:
            # its tokenizer, block keys and events would describe another model
            self.model_mismatch = True
            eng.prom.model_mismatch.labels(self.worker.id).inc()
            log.error("worker %s serves %s, not the configured model %r: keyed on routing "
                      "bytes, its events ignored (approximate mode)", self.worker.id,
                      ", ".join(self.models), self.spec.model)
        elif self.spec.tokenizer:
            self.keyer = await eng.load_keyer(self.spec.tokenizer, self.worker.id)
        if self.kind in ENGINE_KINDS and self.spec.metrics.path:
            self.scraper = eng.new_scraper(self)
            await self.scraper.start()
        self._maybe_token_space()
        # The index ages this worker at its KV capacity in whatever space it is keyed
        # in: a worker that stays on routing bytes (no tokenizer, another model) with
        # its capacity from the YAML was never capped — its guesses grew past what the
        # engine holds and every correction was undone by the next hint.
        self._apply_capacity()
        if self.spec.events.endpoint and self.keyer is not None and not self.model_mismatch:
            self.subscriber, self.block_map = eng.new_subscriber(self)
            await self.subscriber.start()

    # ------------------------------------------------------------- key space

    def _maybe_token_space(self) -> None:
        """Moves to the engine's token space once tokenizer and block size are known.
        The worker's byte-space entries can never match again: they are dropped."""
        if self.keyer is None or not self.block_size or isinstance(self.space, TokenSpace):
            return
        model = self.spec.model or (self.models[0] if self.models else "")
        self.space = TokenSpace(model, self.keyer, self.block_size)
        self.stats.block_tokens = self.block_size
        self.engines.index.drop_worker(self.worker.id)
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
        if cap is None or self.kind is WorkerKind.AGENT:
            return
        bt = self.block_size if isinstance(self.space, TokenSpace) \
            else self.space.block_bytes // 4
        blocks = max(1, cap // max(1, bt))
        if self.engines.cfg.index.learn_capacity:
            if self.learned is None or self.learned.configured != blocks:
                self.learned = LearnedCapacity(blocks)  # a new capacity: learn it afresh
            blocks = self.learned.blocks
        self.engines.index.set_capacity(self.worker.id, blocks)

    # --------------------------------------------------------- engine metrics

    def on_metrics(self, m, now: float) -> None:
        """A fresh /metrics reading (router.engines.engine_metrics.MetricsConsumer)."""
        eng = self.engines
        if self._last_metrics is not None and m.restarted_since(self._last_metrics):
            self.engine_restarted("metrics: process start time changed")
        self._last_metrics = m
        if m.block_size and not self.block_size:
            self.learn_block_size(m.block_size)
        if m.kv_capacity_tokens and not self.spec.kv_capacity_tokens \
                and m.kv_capacity_tokens != self.capacity_tokens:
            self.capacity_tokens = m.kv_capacity_tokens
            self._apply_capacity()
        cap = self.capacity_tokens or 0
        # The engine counts waiting requests, not their tokens nor their wait:
        # router.engines.queue_estimate prices them (the fleet's mean uncached
        # prompt, the engine's own, and its departure rate, whichever is larger).
        self.queue.observe(now, m.waiting_requests, m.prefilled_requests,
                           m.prefix_queries_tokens, m.prefix_hits_tokens)
        rate = self.prefill_rate(now)
        load = Load(queued_requests=m.waiting_requests,
                    queued_tokens=self.queue.queued_tokens(
                        m.waiting_requests, eng.mean_request_tokens, rate),
                    running_requests=m.running_requests,
                    kv_used_tokens=int(m.kv_usage * cap), kv_capacity_tokens=cap,
                    prefill_tokens_per_s=rate)
        eng.pool.report_load(self.worker, load, now,
                             stale_s=self.scraper.stale_after_s if self.scraper else None,
                             engine=True)
        eng.prom.scrape_ok(self.worker.id)

    def on_failure(self, cause, detail: str) -> None:
        self.engines.prom.scrape_failed(self.worker.id, getattr(cause, "value", str(cause)))

    # ------------------------------------------------------------ KV events

    def events_synced(self) -> None:
        if not self.in_sync:
            self.in_sync = True
            log.info("worker %s: KV events in sync (exact index)", self.worker.id)
            if self.learned is not None and self.learned.blocks != self.learned.configured:
                # the engine's events say what it holds now: a cap learned while the
                # index guessed must not evict what they report
                self.learned.blocks = self.learned.configured
                self.engines.index.set_capacity(self.worker.id, self.learned.blocks)

    def events_lost(self, reason: str) -> None:
        """A gap that replay could not fill, a late join or a reset: the worker's
        entries are dropped and rebuilt from the events that follow."""
        self._drop_entries()
        self.in_sync = False
        self.engines.prom.resync(self.worker.id, reason.split(" ")[0])
        if reason not in self._events_logged:
            self._events_logged.add(reason)
            log.warning("worker %s: KV events %s: its index entries were dropped and are "
                        "rebuilt from the events that follow", self.worker.id, reason)

    def engine_restarted(self, why: str) -> None:
        """A new engine process: its cache is empty."""
        self.queue.reset()
        self.engines.pool.engine_restarted(self.worker)
        self._drop_entries()
        self.engines.prom.resync(self.worker.id, "restart")
        log.warning("worker %s restarted (%s): its index entries were dropped",
                    self.worker.id, why)

    def _drop_entries(self) -> None:
        if self.block_map is not None:
            self.block_map.reset()  # clears the worker's index entries too
        else:
            self.engines.index.clear(self.worker.id)

    # ------------------------------------------------------------- responses

    def observe(self, sk: SpaceKey, matched_blocks: int, usage: tuple[int, int] | None,
                ttft_s: float | None, ahead_tokens: int, own_tokens: int,
                now: float, touches: tuple | None = None) -> None:
        """One finished request on this worker.

        ``usage``: (prompt_tokens, cached_tokens) it reported, if any: records the
        prediction error. ``ttft_s`` with the uncached tokens ahead of it at pick
        time and its own is one prefill-rate sample (router.engines.prefill_rate);
        its own are the uncached tokens the worker reported where it did
        (``own_tokens``, the prediction, otherwise).

        Correction (approximate mode): ``touches`` are the matched blocks' last-use
        times before this request. If the worker reports fewer cached tokens than
        predicted, its first missing block j was evicted; an engine evicts least
        recently used blocks first, so every entry of this worker last used before
        ``touches[j]`` is gone too, and leaves the index. The request's own chain
        stays: its prefill has just stored it again. The learned cap follows each
        answer with a match (``router.engines.capacity``, ``index.learn_capacity``).
        """
        eng = self.engines
        if usage is not None:
            # The engine's own count of what it prefilled, not the index's prediction:
            # in approximate mode a prediction that missed cached blocks priced the
            # request's prefill too high, its short TTFT read as a fast worker (one of
            # two equal vLLMs learned 12,400 tokens/s, the other 3,000), and misses
            # herded onto it.
            own_tokens = min(usage[0] - usage[1], MAX_LOAD_COUNT)  # usage_of: 0 <= c <= p
        eng.mean_request_tokens += 0.05 * (own_tokens - eng.mean_request_tokens)
        if ttft_s is not None and ttft_s > 0:
            self.rate.observe(ahead_tokens, own_tokens, ttft_s, now)
            if self.kind is not WorkerKind.AGENT:
                self.engines.pooled_rate.observe(ahead_tokens, own_tokens, ttft_s, now)
        if usage is None:
            return
        prompt, cached = usage
        bt = sk.block_tokens
        if not sk.exact and sk.prompt_tokens:
            # byte space: its blocks in this prompt's real tokens
            bt = max(1, round(bt * prompt / sk.prompt_tokens))
        pred = predicted_tokens(matched_blocks, bt, prompt, self.engine_blocks)
        err = self.stats.record(pred, cached)
        self.engines.prom.prediction(self.worker.id, err)
        if self.corrects:
            n = correct(self.engines.index, self.worker.id, self.learned, matched_blocks,
                        pred, cached, bt, touches)
            if n:
                self.engines.prom.corrected.labels(self.worker.id).inc(n)

    def prefill_rate(self, now: float) -> float:
        """Prefill tokens/s the policy should assume: this worker's learned rate,
        shrunk toward the fleet's (``PrefillRateEstimator.blended``)."""
        e = self.engines
        return self.rate.blended(now, e.pooled_rate.tokens_per_s, e.POOL_WEIGHT_TOKENS)

    @property
    def corrects(self) -> bool:
        """Whether responses correct this worker's entries (the approximate mode)."""
        return self.kind is not WorkerKind.AGENT and not self.in_sync
