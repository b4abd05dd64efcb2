"""The router's engine side: one ``EngineLink`` per worker, key spaces, engine metrics.

``Engines`` follows the pool (``worker_added`` / ``worker_removed``), so every
worker — from the YAML, the admin API, self-registration or discovery — gets a
link, and a removed worker's subscriber and scraper stop with it. The data plane
asks it two things per request::

    keyed = engines.key(endpoint, body, pk, views, now)    a KeyedRequest: the request
            in every key space the routable workers use, their matches merged for
            the policy (radixfleet.engines.keyspace)
    link.observe(placement, usage, ttft, now)            after the response (the
            worker's link): prediction accuracy, approximate-mode correction,
            prefill-rate sample, reported to the fleet's ``rates``

and ``forward_body`` (whether to ask the worker for usage in a stream the client
did not ask it for; the body's ``priority``, the router's on every endpoint: the
request's class in the engine's own order for a worker that schedules by it, else
none). ``spaces_for(views)`` is cached and rebuilt only when a link's
space changes or the routable set does. A link uses of ``Engines`` only what
``link.LinkHost`` declares.

Lifecycle: ``start(session)`` starts the links of the workers present;
``aclose()`` (idempotent) stops them all.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixfleet.config import Config, WorkerSpec, allow_networks, resolve_engine
from radixfleet.engines.adapters import adapter_for
from radixfleet.engines.keyspace import ByteSpace, KeyedRequest, merge_matches
from radixfleet.engines.link import EngineLink, LinkState
from radixfleet.engines.prefill_rate import FleetRates
from radixfleet.fleet.pool import Pool
from radixfleet.index.prefix_index import COLDER_TIERS, PrefixIndex
from radixfleet.keys import Endpoint, PrefixKey
from radixfleet.policies.base import EMPTY_MATCH, MatchResult, RouteRequest, WorkerView
from radixfleet.route.tenancy import PRIORITIES

log = logging.getLogger("radixfleet.engines")

_ABSENT = object()  # a body without the field (null is a value the client sent)

#: absolute prediction errors, tokens
_ERR_BUCKETS = (0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536)


class EnginePrometheus:
    """The engine side's metrics, in the router's registry."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.pred_err = Histogram(
            "radixfleet_prediction_error_tokens",
            "|predicted matched - reported cached| "
            "prompt tokens of the chosen worker, per response that reports cached tokens",
            ["worker"],
            buckets=_ERR_BUCKETS,
            registry=r,
        )
        self.pred_over = Counter(
            "radixfleet_prediction_over",
            "Responses whose cached tokens were fewer than the index predicted",
            ["worker"],
            registry=r,
        )
        self.corrected = Counter(
            "radixfleet_index_corrected_entries",
            "Index entries removed because a worker "
            "reported fewer cached tokens than predicted (approximate mode)",
            ["worker"],
            registry=r,
        )
        self.scrape_fail = Counter(
            "radixfleet_engine_scrape_failures",
            "Failed scrapes of an engine's /metrics",
            ["worker", "cause"],
            registry=r,
        )
        self.load_source = Gauge(
            "radixfleet_engine_load_fresh",
            "1 while the engine's own load (its /metrics) is fresh; 0: the router's own counts only",
            ["worker"],
            registry=r,
        )
        self.event_errors = Counter(
            "radixfleet_engine_event_errors",
            "Malformed or unusable KV event frames",
            ["worker", "cause"],
            registry=r,
        )
        self.event_blocks = Counter(
            "radixfleet_engine_event_blocks",
            "Engine KV event blocks applied to the index",
            ["type"],
            registry=r,
        )
        self.resyncs = Counter(
            "radixfleet_engine_resyncs",
            "Times a worker's index entries were dropped and rebuilt (gap, late join, restart)",
            ["worker", "reason"],
            registry=r,
        )
        self.model_mismatch = Counter(
            "radixfleet_engine_model_mismatch",
            "Workers found serving another model than their configured one (approximate mode)",
            ["worker"],
            registry=r,
        )
        self.tokenizer_errors = Counter(
            "radixfleet_tokenizer_errors", "Tokenizers that could not be loaded", ["worker"], registry=r
        )
        self.keys_off = Counter(
            "radixfleet_engine_tokenizer_unavailable",
            "Times a vLLM/SGLang worker was left keyed on routing bytes (approximate "
            "matches) for want of its engine's tokenizer, per cause: no_root (its engine "
            "names none), unreadable (a path the router cannot read, or a repo not in the "
            "local Hugging Face cache with tokenizers.download off), load_failed, mismatch "
            "(its ids differ from the engine's /tokenize on the probe prompt)",
            ["worker", "cause"],
            registry=r,
        )
        self.engine_tokenize = Counter(
            "radixfleet_engine_tokenize_requests",
            "Requests keyed through an engine's POST /tokenize (radixfleet.engines.engine_keys), "
            "per outcome: fetched, cached (the same body's ids held), failed (an error or "
            "past tokenizers.engine_timeout_s), unkeyed (routed by load: failed, or a request "
            "/tokenize does not render as served)",
            ["outcome"],
            registry=r,
        )
        self.engine_tokenize_s = Histogram(
            "radixfleet_engine_tokenize_seconds",
            "One POST /tokenize round trip, keying a request through its engine",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 10.0),
            registry=r,
        )
        self.prefill_rate = Gauge(
            "radixfleet_worker_prefill_tokens_per_second", "Learned prefill speed", ["worker"], registry=r
        )
        self.truth = Gauge(
            "radixfleet_worker_index_exact",
            "1: the worker's index entries follow its engine's (or agent's) events; 0: approximate",
            ["worker"],
            registry=r,
        )
        self.events_off = Counter(
            "radixfleet_engine_events_unavailable",
            "Times a worker's KV events could not "
            "be followed and it was left in the approximate mode, per cause: missing (no "
            "/kv_event_sources: vLLM before 0.32), empty, disabled, malformed (its answer), "
            "not_allowed (an endpoint it names off its own host, or not tcp://), "
            "no_tokenizer, address_in_use, endpoint_refused (the subscriber's socket), "
            "rank_rejected (the engine refused a data-parallel rank; asked again), "
            "missing_extra (pip install 'radixfleet[engines]')",
            ["worker", "cause"],
            registry=r,
        )
        self.events_ranks = Gauge(
            "radixfleet_engine_event_streams",
            "KV-event streams followed per worker (one "
            "per data-parallel rank) and where their endpoints came from: config (the "
            "worker's events:) or engine (its /kv_event_sources)",
            ["worker", "source"],
            registry=r,
        )
        self.dp_ranks = Gauge(
            "radixfleet_worker_data_parallel_ranks",
            "Data-parallel ranks the router "
            "indexes and routes to separately (X-data-parallel-rank); 0: the worker as one "
            "engine",
            ["worker"],
            registry=r,
        )
        self.event_ignored = Counter(
            "radixfleet_engine_event_ignored_blocks",
            "KV event blocks ignored, per cause: unknown_medium (a medium the router "
            "maps to no tier: logged once a minute), other_group (a hybrid model's other "
            "KV-cache groups)",
            ["worker", "cause"],
            registry=r,
        )
        self.tier_matched = Counter(
            "radixfleet_tier_matched_tokens",
            "Prompt tokens the chosen worker held at pick time, per KV tier: gpu (its "
            "prefix cache), cpu / disk (how far its offloaded blocks extended that prefix)",
            ["worker", "tier"],
            registry=r,
        )
        self.tier_blocks = Gauge(
            "radixfleet_worker_tier_blocks",
            "Blocks the index holds for a worker per KV tier (gpu, cpu, disk)",
            ["worker", "tier"],
            registry=r,
        )
        self.tier_load = Gauge(
            "radixfleet_worker_tier_load_seconds_per_token",
            "Learned seconds per token to load a colder tier's blocks back (seeded from "
            "bandwidth: radixfleet.engines.tier_price)",
            ["worker", "tier"],
            registry=r,
        )
        self.tier_fraction = Gauge(
            "radixfleet_worker_tier_gpu_hit_fraction",
            "What a colder tier's hit is worth as a share of a GPU hit on a worker: 1 - "
            "load seconds per token x prefill tokens per second (radixfleet.engines.tier_price)",
            ["worker", "tier"],
            registry=r,
        )
        self.tier_samples = Counter(
            "radixfleet_worker_tier_load_samples",
            "Answers a worker's colder-tier load price learned from",
            ["worker", "tier"],
            registry=r,
        )

    def prediction(self, worker: str, err: int) -> None:
        self.pred_err.labels(worker).observe(abs(err))
        if err > 0:
            self.pred_over.labels(worker).inc()

    def scrape_ok(self, worker: str) -> None:
        pass  # freshness is read at /metrics time (refresh)

    def scrape_failed(self, worker: str, cause: str) -> None:
        self.scrape_fail.labels(worker, cause).inc()

    def event_error(self, worker: str, cause: str) -> None:
        self.event_errors.labels(worker, cause).inc()

    def resync(self, worker: str, reason: str) -> None:
        self.resyncs.labels(worker, reason).inc()

    def events_unavailable(self, worker: str, cause: str) -> None:
        self.events_off.labels(worker, cause).inc()

    def events_followed(self, worker: str, source: str, streams: int) -> None:
        for s in ("config", "engine"):
            self.events_ranks.labels(worker, s).set(streams if s == source else 0)

    def forget(self, worker: str) -> None:
        for g in (self.load_source, self.prefill_rate, self.truth, self.dp_ranks):
            try:
                g.remove(worker)
            except KeyError:
                pass
        for s in ("config", "engine"):
            try:
                self.events_ranks.remove(worker, s)
            except KeyError:
                pass
        for tier in ("gpu", *COLDER_TIERS):  # a gone worker's tiers leave the page too
            for g in (self.tier_blocks, self.tier_load, self.tier_fraction):
                try:
                    g.remove(worker, tier)
                except KeyError:
                    pass


class Engines:
    """Per-worker engine links and the key spaces in use (module docstring)."""

    #: how long after start ``/readiness`` waits for engine sides to come up
    #: (``settling``): a tokenizer loads in seconds, a join's replay answers in
    #: well under its timeout; past this the router says ready anyway
    READY_WAIT_S = 30.0

    def __init__(
        self,
        cfg: Config,
        pool: Pool,
        index: PrefixIndex,
        registry: CollectorRegistry,
        *,
        keyers: dict | None = None,
    ) -> None:
        """``keyers``: the ``models:`` tokenizers, loaded (radixfleet.config.reload.build)."""
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self.prom = EnginePrometheus(registry)
        self.byte_space = ByteSpace(cfg.keys.block_bytes)
        self.session: aiohttp.ClientSession | None = None
        self.links: dict[str, EngineLink] = {}
        self.rates = FleetRates()  # what the links learn together, and report to
        #: (tokenizer source, chat template) -> TokenKeyer, shared by the workers
        self._keyers: dict[tuple[str, str], Any] = dict(keyers or {})
        #: those of them ``models:`` names (loaded by the config's build, reused on reload)
        self.model_keyers: dict[tuple[str, str], Any] = dict(keyers or {})
        self._keyer_loads: dict[tuple[str, str], asyncio.Future] = {}  # loads under way
        #: (source, served model) -> EngineKeyer: workers keyed through their engine's
        #: /tokenize, shared by those naming the same root (radixfleet.engines.engine_keys)
        self._engine_keyers: dict[tuple[str, str], Any] = {}
        #: of the cached ``_spaces``, those keyed through an engine (``prepare``)
        self._remote: list = []
        self._turn = 0  # rotates which worker of an engine space is asked
        self._spaces_key: tuple | None = None
        self._spaces: list = []
        #: workers indexed per data-parallel rank (link.ranks >= 2): their matches are
        #: folded from their ranks' part holders (``_fold_ranks``)
        self._ranked: set[str] = set()
        self._started = False
        self._started_at = 0.0
        self._closed = False
        pool.listeners.append(self)

    # --------------------------------------------------------------- lifecycle

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._started = True
        self._started_at = time.monotonic()
        for w in list(self.pool):
            self.worker_added(w)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        links = list(self.links.values())
        self.links.clear()
        await asyncio.gather(*(l.aclose() for l in links), return_exceptions=True)

    def configure(self, cfg, *, keyers: dict | None = None) -> None:
        """A reloaded config (block_bytes changes restart the byte space; a worker whose
        settings from ``models:`` change gets a new link, keyed afresh)."""
        old_models = self.cfg.models
        self.cfg = cfg
        if keyers is not None:
            self.model_keyers = dict(keyers)
            self._keyers.update(keyers)
        if cfg.models != old_models:
            for link in list(self.links.values()):
                if link.adapter.pushes:
                    continue  # an agent's link resolves no models: settings
                if self.resolve(self._spec_of(link.worker), link.models) != link.spec:
                    log.info("worker %s: its models: settings changed, new engine link", link.worker.id)
                    self.worker_removed(link.worker)
                    self.index.clear(link.worker.id)
                    self.worker_added(link.worker)
        for ek in self._engine_keyers.values():
            ek.configure(cfg.tokenizers.engine_timeout_s)
        if cfg.keys.block_bytes != self.byte_space.block_bytes:
            self.byte_space = ByteSpace(cfg.keys.block_bytes)
            for link in self.links.values():
                if isinstance(link.space, ByteSpace):
                    link.space = self.byte_space
            self.spaces_changed()

    # ------------------------------------------------------------ pool events

    def worker_added(self, w) -> None:
        if not self._started or self._closed or w.id in self.links:
            return
        link = self.links[w.id] = EngineLink(w, self._spec_of(w), self)
        w.attach(link)
        self.spaces_changed()
        asyncio.get_running_loop().create_task(link.start())

    def worker_removed(self, w) -> None:
        link = self.links.pop(w.id, None)
        if link is None:
            return
        self._ranked.discard(w.id)
        self.prom.forget(w.id)
        self.spaces_changed()
        if link.state is not LinkState.CLOSED:
            asyncio.get_running_loop().create_task(link.aclose())

    def spaces_changed(self) -> None:
        self._spaces_key = None

    @staticmethod
    def _spec_of(w) -> WorkerSpec:
        """The worker's own entry (YAML, admin, discovery), or a self-registered one's."""
        return (
            w.spec
            if w.spec is not None
            else WorkerSpec(url=w.url, id=w.id, kind="agent" if w.source.value == "agent" else "auto")
        )

    def resolve(self, spec: WorkerSpec, served: tuple[str, ...]) -> WorkerSpec:
        """The worker's engine settings with what ``models:`` says of the model it
        serves (radixfleet.config.resolve_engine): the link calls it once it knows."""
        return resolve_engine(spec, self.cfg.models, served)

    def ranks_changed(self, link: EngineLink, n: int) -> None:
        """``link`` now has ``n`` data-parallel ranks (0: none)."""
        if n and self.links.get(link.worker.id) is link:
            self._ranked.add(link.worker.id)
        else:
            self._ranked.discard(link.worker.id)
        self.prom.dp_ranks.labels(link.worker.id).set(n)

    # ---------------------------------------------------------- parts factory

    @property
    def learn_capacity(self) -> bool:
        return self.cfg.index.learn_capacity

    @property
    def events_allowed(self) -> tuple:
        """Where a vLLM's ``/kv_event_sources`` may point besides the worker's own host:
        ``registration.allow``'s networks (radixfleet.engines.event_sources)."""
        return allow_networks(self.cfg.registration.allow)[0]

    @property
    def tokenizers(self):
        """``tokenizers:``: whether and how a worker's tokenizer is found from its engine."""
        return self.cfg.tokenizers

    async def load_keyer(self, source: str, worker: str, chat_template: str = ""):
        """The shared tokenizer of ``source`` (with ``chat_template``, vLLM's
        --chat-template, replacing its own), loaded once, off the event loop (a
        second or two for a real one; links of the same engine wait for the same
        load); None (logged, counted) if it cannot load."""
        options = {"chat_template": chat_template} if chat_template else {}
        try:
            return await self._shared_keyer((source, chat_template), options)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - TokenizerLoadError, or a broken folder
            self.prom.tokenizer_errors.labels(worker).inc()
            log.error(
                "worker %s: tokenizer %s cannot be loaded (%s): keyed on routing bytes "
                "instead, events ignored",
                worker,
                source,
                exc,
            )
            return None

    async def discover_keyer(self, source: str, chat_template: str = "", *, download: bool = False):
        """The shared tokenizer of ``source`` as an engine named it
        (radixfleet.engines.tokenizer_source; with ``chat_template`` replacing its own):
        looked for here first (``locate``), loaded without requiring a chat template
        (the probe compares chats with the engine's), off the event loop. A
        ``KeysProblem`` (not logged: the link says it with the worker) when it cannot
        be read or loaded."""
        from radixfleet.engines.tokenizer_source import KeysCause, KeysProblem, locate

        key = (source, chat_template)
        if key not in self._keyers:
            found = await asyncio.to_thread(locate, source, download)
            if found is not None:
                return found
        options: dict = {"require_chat_template": False}
        if chat_template:
            options["chat_template"] = chat_template
        if download:
            options["download"] = True
        try:
            return await self._shared_keyer(key, options)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - TokenizerLoadError, MissingExtra, a broken folder
            cause = getattr(exc, "cause", None) or " ".join(str(exc).split()) or type(exc).__name__
            return KeysProblem(KeysCause.LOAD_FAILED, f"tokenizer {source!r}: {cause}"[:500])

    async def _shared_keyer(self, key: tuple[str, str], options: dict):
        """The keyer of ``key`` (source, chat template): one load at a time per key,
        shared by every link that asks meanwhile; a failed load is forgotten (a
        later ask, after an engine restart, tries again). Raises what the load raised."""
        k = self._keyers.get(key)
        if k is not None:
            return k
        fut = self._keyer_loads.get(key)
        if fut is None:
            fut = self._keyer_loads[key] = asyncio.ensure_future(
                asyncio.to_thread(_load_token_keyer, key[0], options)
            )
            fut.add_done_callback(functools.partial(self._load_done, key))
        k = await asyncio.shield(fut)
        self._keyers.setdefault(key, k)
        return self._keyers[key]

    def _load_done(self, key: tuple[str, str], fut: asyncio.Future) -> None:
        if self._keyer_loads.get(key) is fut:
            del self._keyer_loads[key]
        if not fut.cancelled() and fut.exception() is None:
            self._keyers.setdefault(key, fut.result())

    def engine_keyer(self, source: str, model: str):
        """The shared ``EngineKeyer`` of workers whose engine named ``source`` (or, with
        no root, the worker's URL) serving ``model``."""
        from radixfleet.engines.engine_keys import EngineKeyer

        key = (source, model)
        k = self._engine_keyers.get(key)
        if k is None:
            k = self._engine_keyers[key] = EngineKeyer(
                f"engine:{source}", model, timeout_s=self.cfg.tokenizers.engine_timeout_s, prom=self.prom
            )
        return k

    async def prepare(self, endpoint: Endpoint, body: dict, views: Sequence[WorkerView]) -> bool:
        """Readies the request for ``key`` in every space keyed through an engine
        among ``views`` (radixfleet.engines.engine_keys: one /tokenize round trip each,
        unless cached). True when it awaited: the views may be stale. O(1) when no
        routable worker is keyed through its engine."""
        self.spaces_for(views)
        remote = self._remote
        if not remote or self.session is None:
            return False
        waits = []
        for sp, wids in remote:
            links = [link for w in wids if (link := self.links.get(w)) is not None]
            if not links:
                continue
            self._turn += 1
            url = links[self._turn % len(links)].worker.url
            waits.append(sp.keyer.prepare(self.session, url, endpoint, body))
        done = await asyncio.gather(*waits)
        return any(done)

    def new_scraper(self, link: EngineLink):
        from radixfleet.engines.engine_metrics import MetricsScraper

        ms, kind = link.spec.metrics, link.adapter.metrics
        assert kind is not None and self.session is not None, "a scraped kind, after the session"
        return MetricsScraper(
            link.worker.url + ms.path,
            kind,
            self.session,
            link,
            interval_s=ms.interval_s,
            timeout_s=ms.timeout_s,
            model=link.spec.model or None,
            name=link.worker.id,
        )

    def new_subscriber(self, link: EngineLink, source=None, rank: int | None = None):
        from radixfleet.engines.wiring import subscribe

        return subscribe(link, self, source, rank)

    # ------------------------------------------------------------- data plane

    def spaces_for(self, views: Sequence[WorkerView]) -> list:
        """[(space, [worker ids])], the most used space first. Cached."""
        ids = tuple(v.id for v in views)
        if self._spaces_key == ids:
            return self._spaces
        groups: dict = {}
        links = self.links
        for wid in ids:
            link = links.get(wid)
            sp = link.space if link is not None else self.byte_space
            g = groups.get(sp.id)
            if g is None:
                groups[sp.id] = (sp, [wid])
            else:
                g[1].append(wid)
        self._spaces = sorted(groups.values(), key=lambda g: -len(g[1]))
        self._remote = [g for g in self._spaces if hasattr(getattr(g[0], "keyer", None), "prepare")]
        self._spaces_key = ids
        return self._spaces

    def key(
        self,
        endpoint: Endpoint,
        body: dict,
        pk: PrefixKey,
        session: str | None,
        views: Sequence[WorkerView],
        now: float,
    ) -> KeyedRequest:
        """The request in every space in use, and the policy's view of it.
        Raises ``MalformedRequest`` (a token space refusing the body)."""
        groups = self.spaces_for(views)
        index = self.index
        keys: dict = {}
        matches: dict = {}
        space_of: dict = {}
        others = []
        ranks: dict = {}
        tiers: dict = {}
        tiers_on = self.cfg.index.tiers != "ignore"  # index.tiers: ignore, a miss
        for i, (sp, wids) in enumerate(groups):
            sk = sp.key(endpoint, body, pk)
            keys[sp.id] = sk
            m = index.match(sk.hashes, now, count=(i == 0)) if sk.hashes else EMPTY_MATCH
            t = index.match_tiers(sk.hashes, m) if sk.hashes and tiers_on else None
            if t:
                tiers.update(t)
            if self._ranked and m.blocks:
                m = _fold_ranks(m, ranks)
            matches[sp.id] = m
            for wid in wids:
                space_of[wid] = sp
            if i:
                others.append((sk, m, wids))
        psp = groups[0][0]
        psk = keys[psp.id]
        match = merge_matches(psk, matches[psp.id], others)
        if tiers:
            match = self._priced(match, tiers, keys, space_of, psk.block_tokens, now)
        req = RouteRequest(psk.hashes, psk.prompt_tokens, psk.block_tokens, session, pk.model, len(pk.data))
        return KeyedRequest(keys, matches, psp.id, req, match, space_of, ranks, tiers)

    def _priced(
        self, match: MatchResult, tiers: dict, keys: dict, space_of: dict, pbt: int, now: float
    ) -> MatchResult:
        """``match`` with ``colder``: per worker, its colder extension's worth in GPU-hit
        blocks of the primary space (``EngineLink.colder_value``; a data-parallel
        worker at its best rank's)."""
        colder: dict = {}
        links = self.links
        pbt = max(1, pbt)
        as_gpu = self.cfg.index.tiers == "as_gpu"
        for holder, ext in tiers.items():
            wid = holder.partition("#")[0]
            link = links.get(wid)
            sp = space_of.get(wid)
            if link is None or sp is None:
                continue
            if as_gpu:  # index.tiers: as_gpu, a full GPU hit
                v = sum(ext.values()) * keys[sp.id].block_tokens / pbt
            else:
                v = link.colder_value(ext, keys[sp.id].block_tokens, now) / pbt
            if v > colder.get(wid, 0.0):
                colder[wid] = v
        if not colder:
            return match
        return MatchResult(match.blocks, match.depth, match.rate, match.private, colder)

    def link(self, worker: str) -> EngineLink | None:
        return self.links.get(worker)

    def forward_body(
        self,
        link: EngineLink | None,
        endpoint: Endpoint,
        body: dict,
        raw: bytes | bytearray,
        stream: bool,
        priority: int | None = None,
    ) -> tuple[bytes | bytearray, bool]:
        """The bytes to send and whether the usage event must be hidden: a stream
        whose client did not ask for usage gets ``stream_options.include_usage`` so
        the router learns the cached tokens (OpenAI endpoints; SGLang's /generate
        reports them in every event's meta_info).

        The body's ``priority`` is the router's, on every endpoint (``/generate``
        too: agents and SGLang read it there): ``priority`` is the request's class
        rank (``radixfleet.route.tenancy.PRIORITIES`` index; None: none), sent as
        ``engine_priority`` says where the worker schedules by it, and a client's
        own value is dropped where it does not -- it would reorder an engine queue
        the router's classes do not (tenancy has already weighed a claim, made with
        its priority header, in choosing the class). The raw bytes go unchanged when
        nothing changes."""
        usage = stream and endpoint is not Endpoint.GENERATE
        so = body.get("stream_options")
        if usage and (
            (isinstance(so, dict) and so.get("include_usage") is True)
            or (so is not None and not isinstance(so, dict))  # the worker answers the client's own mistake
        ):
            usage = False
        value = engine_priority(link, priority)
        own = body.get("priority", _ABSENT)
        if value is None:
            change = own is not _ABSENT  # dropped
        else:
            change = type(own) is not int or own != value
        if not usage and not change:
            return raw, False
        b = dict(body)
        if usage:
            b["stream_options"] = {**(so or {}), "include_usage": True}
        if change:
            if value is None:
                del b["priority"]
            else:
                b["priority"] = value
        out = json.dumps(b, ensure_ascii=False, separators=(",", ":"))
        return out.encode("utf-8", "surrogatepass"), usage

    def settling(self, now: float) -> list[str]:
        """The healthy workers whose engine side is still coming up (``EngineLink.
        settling``: tokenizer, event subscription, the join's replay), which
        ``/readiness`` waits for — during the router's first ``READY_WAIT_S`` only:
        an engine whose events never connect serves approximate after that, and a
        worker added later never takes a serving router out of rotation."""
        if not self._started or now - self._started_at > self.READY_WAIT_S:
            return []
        return [
            wid
            for wid, link in self.links.items()
            if link.settling and (w := self.pool.get(wid)) is not None and w.health.value == "healthy"
        ]

    def refresh(self, now: float) -> None:
        """Copies link state into gauges (at /metrics time)."""
        for wid, link in self.links.items():
            self.prom.load_source.labels(wid).set(1 if link.engine_load_fresh(now) else 0)
            self.prom.prefill_rate.labels(wid).set(link.prefill_rate(now))
            self.prom.truth.labels(wid).set(0 if link.truth.value == "approximate" else 1)
            for tier, d in link.tier_describe(now).items():
                self.prom.tier_blocks.labels(wid, tier).set(d["blocks"])
                if "load_s_per_token" in d:
                    self.prom.tier_load.labels(wid, tier).set(d["load_s_per_token"])
                    self.prom.tier_fraction.labels(wid, tier).set(d["gpu_hit_fraction"])


def engine_priority(link: EngineLink | None, rank: int | None) -> int | None:
    """The body ``priority`` a request of class ``rank`` (``PRIORITIES`` index) gets
    on the worker of ``link``, in its engine's own order; None where the worker does
    not schedule by priority (``sends_priority``) or the request has no class. vLLM
    and agents serve lower values first: critical 0, standard 1, sheddable 2. SGLang
    serves higher ones first (its default; ``--schedule-low-priority-values-first``
    reverses it, and is not followed here): critical 2, standard 1, sheddable 0."""
    if rank is None or link is None or not sends_priority(link):
        return None
    return adapter_for(link.kind).priority(rank, len(PRIORITIES))


def sends_priority(link: EngineLink) -> bool:
    """Whether the worker of ``link`` gets vLLM's body ``priority``: an agent that
    announced its waiting order decides (``priority`` or not), else the entry's
    ``priority_field`` (its own, a ``models:`` entry's or its selector's)."""
    said = link.worker.scheduling_policy
    return said == "priority" if said else link.spec.priority_field


def _fold_ranks(m, ranks: dict):
    """``m`` with each data-parallel rank's part holder (``"<worker>#<rank>"``,
    ``EngineLink.holder``) folded into its worker at the best rank's blocks — the
    policy sees workers — and the ranks' own blocks added to ``ranks`` (worker ->
    {rank: blocks}) for the pick of the rank."""
    blocks = None
    for h, b in m.blocks.items():
        wid, sep, r = h.partition("#")
        if not sep:
            continue
        if blocks is None:
            blocks = {k: v for k, v in m.blocks.items() if "#" not in k}
        ranks.setdefault(wid, {})[int(r)] = b
        if b > blocks.get(wid, 0):
            blocks[wid] = b
    if blocks is None:
        return m
    return MatchResult(blocks, m.depth, m.rate, m.private)


def _load_token_keyer(source: str, options: dict):
    """``TokenKeyer.load``, its module imported here (off the loop): without the
    'engines' extra that import raises MissingExtra, which ``load_keyer`` logs and
    counts as a tokenizer that cannot load (the worker is keyed on routing bytes)."""
    from radixfleet.engines.token_keys import TokenKeyer

    return TokenKeyer.load(source, **options)
