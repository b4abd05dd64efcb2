"""The agent's HTTP surface (aiohttp): OpenAI API, SGLang's worker probes, /metrics.

::

    POST /v1/completions, /v1/chat/completions, /generate   (SSE when "stream": true)
    GET  /v1/models
    GET  /health /health_generate /get_server_info /server_info /get_model_info
         /model_info /get_load                            (what SGLang's router probes)
    GET|POST /flush_cache
    POST /internal/v1/engine_config   new RoPE scaling -> fingerprint change -> flush
                                      (agent token required when one is set)
    GET  /metrics         sglang:* gauges beside radixfleet_agent_* counters
    GET  /openapi.json    radixfleet.wire.openapi.agent_spec()

A request's prompt is ``radixfleet.keys.routing_bytes`` of its body (the chat
template), tokenized by ``radixfleet_tools.agent.tokenizer``; its cache namespace and router
hashes come from ``request_key(..., tenant=<x-radixfleet-tenant header>)``, exactly
as the router computes them. The header is the router's secret per-tenant salt
(radixfleet.common.tenancy), taken only from a router: with an agent token set it must come
with the router's signature (``x-radixfleet-tenant-sig``), else 401; without one,
only on a loopback listener (``trust_unsigned_tenant``). A full wait queue
(``SchedulerConfig.max_waiting``) answers 429 with ``Retry-After``. Bad input answers an
OpenAI-style JSON error with a 4xx
status and touches nothing already accepted; a client that goes away cancels its
request and frees its KV. A body's integer ``priority`` (vLLM's field: lower first)
orders the wait queue of an agent started with ``--schedule priority``; any other
agent refuses a non-zero one (400, as vLLM without ``--scheduling-policy
priority``). Extra fields (SGLang's ``no_stop_trim``,
``skip_special_tokens``, ``return_hidden_states``, sampling knobs) are accepted and
ignored: the simulated engine generates ``max_tokens`` deterministic tokens.
A finished request's answer ends (the non-streamed body; a stream's finish chunk,
usage and ``[DONE]``) only after the reporter delivered the cache events it made
(``Reporter.flush``, at most its interval): a conversation's next turn, sent the
moment the answer is in, finds the answer's blocks in the router's index.

Disaggregated prefill/decode, vLLM's protocol (``kv_transfer_params``, as
``radixfleet.route.pd`` and vLLM's NIXL/P2P connectors speak it; any role accepts both legs)::

    prefill leg  {"do_remote_decode": true, ...}  -> the prompt runs as any (its
                 cache hit counts, its KV stays in the tree and its events go out);
                 a non-streamed answer carries kv_transfer_params naming this agent:
                 do_remote_prefill true, remote_engine_id (its worker id),
                 remote_block_ids (the router block hashes of the prompt's whole
                 blocks), remote_host/remote_port (its advertised address)
    decode leg   {"do_remote_prefill": true, remote_engine_id: str, remote_block_ids:
                 [int], remote_host: str, remote_port: int} -> the prompt's KV is
                 pulled instead of computed: the part this agent does not hold
                 locally costs the link's transfer time (``--kv-link``, the
                 simulator's ``LINKS``; the scheduler's "Remote KV"), the last
                 prompt token is computed, the prompt joins the tree, decode goes on

Block ids that are not this prompt's whole-block hashes name another prompt's KV:
400, as a failed KV pull is an error in vLLM; so are wrong types (the error names
the field). The prefill side does not pin the KV until it is pulled (vLLM's
connector does): it is evictable in the tree like any prompt's. A decode leg's
``usage.prompt_tokens_details.cached_tokens`` counts only what this agent reused
from its own tree and DRAM tier, not the transferred tokens: a router reads it as
what the worker held before the request (``PrefixIndex.keep``'s correction, the
learned capacity), and the transferred prompt was not held here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixfleet.common import jsonbody
from radixfleet.common.auth import BearerAuth
from radixfleet.common.metrics import standard_collectors
from radixfleet.common.tenancy import SIGNATURE_HEADER, verify_signature
from radixfleet.keys import (
    BYTES_PER_TOKEN,
    DEFAULT_BLOCK_BYTES,
    Endpoint,
    block_hashes,
    check_block_bytes,
    namespace_seed,
    request_key,
)
from radixfleet.wire.errors import (
    MalformedRequest,
    NotFound,
    PromptTooLarge,
    RequestError,
    Unauthorized,
    retry_after_header,
)
from radixfleet.wire.openapi import agent_spec
from radixfleet_tools.agent import tokenizer as tk
from radixfleet_tools.agent.cost_model import DEFAULT_LINK, link_preset
from radixfleet_tools.agent.dram_tier import DramConfig
from radixfleet_tools.agent.engine import Engine
from radixfleet_tools.agent.radix_cache import AdmissionConfig
from radixfleet_tools.agent.scheduler import SchedRequest, SchedulerConfig, State, build_scheduler

if TYPE_CHECKING:  # the keys' types; the app imports them where they are used
    from radixfleet.common.tracing import Tracing
    from radixfleet_tools.agent.reporter import Reporter

log = logging.getLogger(__name__)

TENANT_HEADER = "x-radixfleet-tenant"
#: max_tokens when a request names none (OpenAI's completions default)
DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class AgentConfig:
    model: str = "llama-3-8b"
    gpu: str = "h100"
    tp: int = 1
    mfu: float = 0.6
    #: explicit KV pool size; None: from the presets
    kv_tokens: int | None = None
    #: the name clients use in "model"; default: the model preset's name
    served_model_name: str | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    #: the role it registers with (radixfleet.route.pd): prefill, decode or both
    role: str = "both"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    worker_id: str = ""
    #: engine settings that change what KV means (RoPE scaling, ...): part of the fingerprint
    rope_scaling: str | None = None
    #: KV page size in tokens: prefixes match and are kept in whole pages (SGLang's
    #: --page-size); 1 = a match may end at any token
    page_size: int = 1
    #: no prefix cache at all (SGLang's --disable-radix-cache): the A/B baseline
    disable_radix_cache: bool = False
    #: a DRAM KV tier below the pool (``--dram-tokens``; None: HBM only)
    dram: DramConfig | None = None
    #: without an agent token, honour an unsigned x-radixfleet-tenant header (only
    #: safe when nobody but the router can reach the agent: a loopback listener)
    trust_unsigned_tenant: bool = True
    #: the link preset (``cost_model.LINKS``) remote KV arrives over (``--kv-link``)
    kv_link: str = DEFAULT_LINK
    #: the OTLP/HTTP traces URL its spans go to (``--otlp-traces-endpoint``, vLLM's
    #: flag); "": no traces, and OpenTelemetry is never imported
    otlp_traces_endpoint: str = ""

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class Agent:
    """The simulated engine behind the HTTP API: cache, pool, scheduler, real-time loop."""

    def __init__(self, cfg: AgentConfig, *, record_events: bool = True) -> None:
        """``record_events``: keep the cache's event log (only a reporter drains it,
        so an agent without routers must not record, or the log would grow forever)."""
        check_block_bytes(cfg.block_bytes)
        self.cfg = cfg
        self.block_tokens = cfg.block_bytes // BYTES_PER_TOKEN
        self.fingerprint = (cfg.model, cfg.tp, cfg.rope_scaling)
        self.sched = build_scheduler(
            cfg.model,
            cfg.gpu,
            tp=cfg.tp,
            mfu=cfg.mfu,
            kv_tokens=cfg.kv_tokens,
            hash_stride=self.block_tokens,
            admission=cfg.admission,
            config=cfg.scheduler,
            fingerprint=self.fingerprint,
            record_events=record_events,
            page_size=cfg.page_size,
            disable_radix_cache=cfg.disable_radix_cache,
            dram=cfg.dram,
            link=link_preset(cfg.kv_link, "--kv-link"),
        )
        self.cost = self.sched.cost
        self.cache = self.sched.cache
        self.pool = self.sched.pool
        self.engine = Engine(self.sched)
        self.started_at = time.time()
        self._ids = itertools.count(1)
        self.bad_requests = 0
        #: prefills answered with kv_transfer_params for a remote decode
        self.remote_decode_prefills = 0
        #: the address this agent advertises (its kv_transfer_params name it; None:
        #: the listening socket's); set by ``create_app``
        self.advertise_url: str | None = None

    @property
    def engine_id(self) -> str:
        """The id this agent registers and names itself by in kv_transfer_params."""
        return self.cfg.worker_id or self.advertise_url or "agent"

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def next_id(self) -> int:
        return next(self._ids)


# ----------------------------------------------------------------- request parsing


def _int_field(body: dict, name: str, default: int, limit: int, where: str | None = None) -> int:
    v = body.get(name)
    if v is None:
        return default
    label = where or name
    if type(v) is not int:
        raise MalformedRequest(f"'{label}' must be an integer, got {type(v).__name__}", param=label)
    if v < 0:
        raise MalformedRequest(f"'{label}' must be >= 0, got {v}", param=label)
    if v > limit:
        raise PromptTooLarge(f"'{label}' is {v}, above this worker's KV pool of {limit} tokens", param=label)
    return v


def _bool_field(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise MalformedRequest(f"'{name}' must be a boolean", param=name)
    return v


#: kv_transfer_params fields a decode leg (do_remote_prefill) must carry, and their types
_REMOTE_FIELDS = (
    ("remote_engine_id", str),
    ("remote_block_ids", list),
    ("remote_host", str),
    ("remote_port", int),
)


def _kv_transfer(body: dict) -> tuple[bool, dict | None]:
    """``(remote_decode, remote)`` of a body's ``kv_transfer_params``: whether it
    asks for a prefill kept for a remote decode, and the checked params of a
    remote prefill to pull (None: none). ``MalformedRequest`` names a field of the
    wrong type (module docstring)."""
    params = body.get("kv_transfer_params")
    if params is None:
        return False, None
    if not isinstance(params, dict):
        raise MalformedRequest("'kv_transfer_params' must be an object", param="kv_transfer_params")
    flags = []
    for name in ("do_remote_decode", "do_remote_prefill"):
        v = params.get(name, False)
        if v is not None and not isinstance(v, bool):
            where = f"kv_transfer_params.{name}"
            raise MalformedRequest(f"'{where}' must be a boolean", param=where)
        flags.append(bool(v))
    remote_decode, remote_prefill = flags
    if remote_decode and remote_prefill:
        raise MalformedRequest(
            "'kv_transfer_params' asks for both do_remote_decode and do_remote_prefill; "
            "a leg is one or the other",
            param="kv_transfer_params.do_remote_prefill",
        )
    if not remote_prefill:
        return remote_decode, None
    for name, kind in _REMOTE_FIELDS:
        v = params.get(name)
        where = f"kv_transfer_params.{name}"
        if type(v) is not kind or (kind is str and not v):
            what = {str: "a non-empty string", list: "a list of integers", int: "an integer"}[kind]
            raise MalformedRequest(
                f"'{where}' must be {what} with do_remote_prefill, got {type(v).__name__}", param=where
            )
    ids = params["remote_block_ids"]
    if not all(type(b) is int for b in ids):
        where = "kv_transfer_params.remote_block_ids"
        raise MalformedRequest(f"'{where}' must be a list of integers", param=where)
    if not 0 < params["remote_port"] < 65536:
        where = "kv_transfer_params.remote_port"
        raise MalformedRequest(f"'{where}' must be a TCP port (1-65535)", param=where)
    return False, params


#: vLLM's bound on ``priority`` (a signed 64-bit integer)
_INT64 = 2**63


def _priority_field(body: dict, order: str) -> int:
    """The request's ``priority`` (vLLM's body field: lower is served first; 0 when
    absent or null). Not an integer (a bool is not one), or outside vLLM's int64
    bounds: ``MalformedRequest``. A non-zero value when this agent does not
    schedule by priority: ``MalformedRequest`` as well, the contract vLLM documents
    (0.32, ``entrypoints/openai/completion/protocol.py``: "Any priority other than 0
    will raise an error if the served model does not use priority scheduling"),
    though 0.32's first-come queue (``v1/core/sched/request_queue.py``) ignores the
    value and no check enforcing it was found in its source: a caller that counted
    on the order must learn it is not kept. vLLM's ``X-Vllm-Priority`` header, which
    overrides the body there, is not read: the router forwards no client header."""
    v = body.get("priority")
    if v is None:
        return 0
    if type(v) is not int:
        raise MalformedRequest(f"'priority' must be an integer, got {type(v).__name__}", param="priority")
    if not -_INT64 <= v < _INT64:
        raise MalformedRequest("'priority' must be a 64-bit signed integer", param="priority")
    if v and order != "priority":
        raise MalformedRequest(
            f"'priority' {v} needs priority scheduling; this agent schedules {order} "
            "(start it with --schedule priority)",
            param="priority",
        )
    return v


@dataclass(slots=True)
class Parsed:
    endpoint: Endpoint
    body: dict
    model: str
    max_new: int
    stream: bool
    include_usage: bool
    req: SchedRequest
    #: a prefill kept for a remote decode: the answer carries kv_transfer_params
    remote_decode: bool = False
    #: the router block hashes of the prompt's whole blocks (what the params name)
    block_ids: list[int] = field(default_factory=list)  # not copied: the request key's


def _parse(agent: Agent, endpoint: Endpoint, body: Any, tenant: str) -> Parsed:
    if not isinstance(body, dict):
        raise MalformedRequest(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        tenant.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedRequest(f"the {TENANT_HEADER} header must be valid UTF-8") from None
    cap = agent.capacity
    name = agent.cfg.name
    if endpoint is Endpoint.GENERATE:
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise MalformedRequest("'sampling_params' must be an object", param="sampling_params")
        max_new = _int_field(sp, "max_new_tokens", DEFAULT_MAX_TOKENS, cap, "sampling_params.max_new_tokens")
        for f in ("text", "input_ids"):
            v = body.get(f)
            if isinstance(v, list) and v and isinstance(v[0], (str, list)) and len(v) > 1:
                raise MalformedRequest(
                    f"batched '{f}' is not supported; send one prompt per request", param=f
                )
    else:
        field_name = "max_tokens"
        if endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
            field_name = "max_completion_tokens"
        max_new = _int_field(body, field_name, DEFAULT_MAX_TOKENS, cap)
        n = body.get("n", 1)
        if n is not None and n != 1:
            raise MalformedRequest("only 'n': 1 is supported", param="n")
        prompt = body.get("prompt")
        if (
            endpoint is Endpoint.COMPLETIONS
            and isinstance(prompt, list)
            and len(prompt) > 1
            and isinstance(prompt[0], (str, list))
        ):
            raise MalformedRequest(
                "batched 'prompt' is not supported; send one prompt per request", param="prompt"
            )
    stream = _bool_field(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise MalformedRequest("'stream_options' must be an object", param="stream_options")
        include_usage = _bool_field(so, "include_usage")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise MalformedRequest("'seed' must be an integer", param="seed")
    remote_decode, remote = _kv_transfer(body)
    priority = _priority_field(body, agent.cfg.scheduler.order)
    key = request_key(endpoint, body, tenant=tenant, block_bytes=agent.cfg.block_bytes)
    if endpoint is not Endpoint.GENERATE or key.model:
        if key.model != name:
            raise NotFound(
                f"model {key.model!r} is not served here; this agent serves {name!r}", param="model"
            )
    prompt_tokens = tk.encode(key.data)
    if not prompt_tokens:
        raise MalformedRequest("the prompt is empty", param="prompt")
    gseed = seed if seed is not None else tk.request_seed(key.data, agent.cfg.seed)
    output = tk.generate(gseed, max_new)
    if tk.is_aligned(prompt_tokens):
        # the answer's blocks are keyed exactly as the next turn's prompt will key them
        hashes = block_hashes(
            key.data + tk.decode(output), namespace_seed(key.model, tenant, key.adapter), key.block_bytes
        )
    else:
        hashes = key.hashes  # a partial tail token: nothing after it matches a re-tokenization
    ns = (key.model, tenant, key.adapter)
    block_ids = key.hashes  # the prompt's whole blocks (a list: compared, sent as is)
    if remote is not None and remote["remote_block_ids"] != block_ids:
        where = "kv_transfer_params.remote_block_ids"
        raise MalformedRequest(
            f"'{where}' are not this prompt's blocks ({len(remote['remote_block_ids'])} ids for "
            f"{len(block_ids)} blocks): the remote KV is another prompt's",
            param=where,
        )
    req = SchedRequest(agent.next_id(), ns, prompt_tokens, max_new, output, hashes, priority)
    if remote is not None:
        req.remote = len(prompt_tokens)  # the prefill side computed the whole prompt
    return Parsed(
        endpoint, body, key.model or name, max_new, stream, include_usage, req, remote_decode, block_ids
    )


# ----------------------------------------------------------------- responses


def _usage(r: SchedRequest, generated: int) -> dict:
    n = len(r.prompt)
    return {
        "prompt_tokens": n,
        "completion_tokens": generated,
        "total_tokens": n + generated,
        "prompt_tokens_details": {"cached_tokens": r.cached},
    }


def _text(r: SchedRequest, a: int, b: int) -> str:
    return tk.decode(r.output[a:b]).decode("ascii")


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _wait_done(w) -> None:
    while not w.done:
        await w.event.wait()
        w.event.clear()


async def _events_first(request: web.Request) -> None:
    """Delivers the cache events so far to the routers before an answer ends
    (module docstring; ``Reporter.flush``)."""
    reporter = request.app.get(REPORTER_KEY)
    if reporter is not None:
        await reporter.flush()


def _tenant(request: web.Request) -> str:
    """The namespace salt of a request: the router's, checked (module docstring)."""
    tenant = request.headers.get(TENANT_HEADER)
    if tenant is None:
        return ""
    auth: BearerAuth = request.app[AUTH_KEY]
    if auth.token:
        if not verify_signature(auth.token, tenant, request.headers.get(SIGNATURE_HEADER)):
            raise Unauthorized(
                f"{TENANT_HEADER} is accepted only with the router's "
                f"{SIGNATURE_HEADER} (same RADIXFLEET_AGENT_TOKEN on both)"
            )
    elif not request.app[AGENT_KEY].cfg.trust_unsigned_tenant:
        raise Unauthorized(
            f"{TENANT_HEADER} is accepted only from a router: set "
            "RADIXFLEET_AGENT_TOKEN on the agent and the router"
        )
    return tenant


async def _serve(agent: Agent, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """One request; traced (vLLM's ``llm_request`` span, a child of the router's
    attempt through its ``traceparent``) when the agent exports traces and the
    request is sampled."""
    tracing = request.app[TRACING_KEY].tracing
    trace = tracing.start(request.headers, "llm_request") if tracing is not None else None
    if trace is None:
        return await _answer(agent, request, endpoint, None)
    try:
        return await _answer(agent, request, endpoint, trace.attrs)
    except RequestError as exc:
        trace.error = exc.code
        raise
    except BaseException as exc:  # noqa: BLE001 - labelled, then re-raised
        trace.error = type(exc).__name__
        raise
    finally:
        trace.end()


async def _answer(
    agent: Agent, request: web.Request, endpoint: Endpoint, span: dict[str, Any] | None
) -> web.StreamResponse:
    """``_serve``'s answer; ``span``: the traced request's attributes, filled in
    (vLLM's names: token counts and latencies, never text)."""
    tenant = _tenant(request)
    body = jsonbody.loads(await request.read())  # bounded depth, finite numbers, UTF-8
    p = _parse(agent, endpoint, body, tenant)
    r = p.req
    if span is not None:
        span["gen_ai.response.model"] = p.model
        span["gen_ai.request.max_tokens"] = r.max_new
        span["gen_ai.usage.prompt_tokens"] = len(r.prompt)
    w = agent.engine.submit(r)  # PromptTooLarge, Overloaded: the scheduler withdrew the hint
    created = int(time.time())
    try:
        if not p.stream:
            await _wait_done(w)
            if r.state is not State.FINISHED:
                raise web.HTTPServiceUnavailable(text="engine stopped", headers={"Retry-After": "1"})
            await _events_first(request)
            answer = _final(p, r, created)
            if p.remote_decode and p.endpoint is not Endpoint.GENERATE:
                answer["kv_transfer_params"] = _remote_params(agent, request, p, r)
                agent.remote_decode_prefills += 1
            return web.json_response(answer)
        return await _stream(p, r, w, request, created)
    finally:
        if r.state not in (State.FINISHED, State.CANCELLED):
            agent.engine.cancel(r)  # the client went away: free its KV now
        if span is not None:
            span["gen_ai.request.id"] = str(r.rid)
            span["gen_ai.usage.completion_tokens"] = r.generated
            span["gen_ai.usage.cached_tokens"] = r.cached
            if r.ttft is not None:
                span["gen_ai.latency.time_to_first_token"] = r.ttft
            if r.finished_at is not None:
                span["gen_ai.latency.e2e"] = r.finished_at - r.arrival


def _address(agent: Agent, request: web.Request) -> tuple[str, int]:
    """(host, port) a decode worker reaches this agent at: the advertised URL's,
    else the listening socket's."""
    if agent.advertise_url:
        u = urlsplit(agent.advertise_url)
        if u.hostname and u.port:
            return u.hostname, u.port
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    if sock:
        return str(sock[0]), int(sock[1])
    return request.url.host or "", request.url.port or 0


def _remote_params(agent: Agent, request: web.Request, p: Parsed, r: SchedRequest) -> dict:
    """A prefill answer's ``kv_transfer_params``: where a decode worker pulls the
    prompt's KV from (module docstring)."""
    host, port = _address(agent, request)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": agent.engine_id,
        "remote_block_ids": p.block_ids,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": str(r.rid),
        "tp_size": agent.cfg.tp,
    }


def _final(p: Parsed, r: SchedRequest, created: int) -> dict:
    g = r.generated
    text = _text(r, 0, g)
    if p.endpoint is Endpoint.GENERATE:
        return {
            "text": text,
            "output_ids": list(r.output[:g]),
            "meta_info": {
                "id": str(r.rid),
                "prompt_tokens": len(r.prompt),
                "completion_tokens": g,
                "cached_tokens": r.cached,
                "finish_reason": {"type": "length", "length": g},
                "e2e_latency": (r.finished_at or 0) - r.arrival,
            },
        }
    if p.endpoint is Endpoint.CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
        }
        obj = "chat.completion"
        rid = f"chatcmpl-{r.rid}"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
        rid = f"cmpl-{r.rid}"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": p.model,
        "choices": [choice],
        "usage": _usage(r, g),
    }


async def _stream(p: Parsed, r: SchedRequest, w, request: web.Request, created: int):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chat = p.endpoint is Endpoint.CHAT
    gen = p.endpoint is Endpoint.GENERATE
    rid = f"chatcmpl-{r.rid}" if chat else f"cmpl-{r.rid}"
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_null = {"usage": None} if p.include_usage else {}

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            d: dict = {"role": "assistant"} if role else {}
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": p.model,
            "choices": [choice],
            **usage_null,
        }

    sent = 0
    if chat:
        await resp.write(_sse(chunk("", None, role=True)))
    while True:
        await w.event.wait()
        w.event.clear()
        if w.visible > sent:
            if gen:
                await resp.write(
                    _sse(
                        {
                            "text": _text(r, 0, w.visible),
                            "meta_info": {
                                "id": str(r.rid),
                                "prompt_tokens": len(r.prompt),
                                "completion_tokens": w.visible,
                                "cached_tokens": r.cached,
                            },
                        }
                    )
                )
            else:
                await resp.write(_sse(chunk(_text(r, sent, w.visible), None)))
            sent = w.visible
        if w.done:
            break
    if r.state is not State.FINISHED:
        raise ConnectionResetError("engine stopped")
    await _events_first(request)
    if gen:
        if sent == 0:
            await resp.write(_sse(_final(p, r, created)))
    else:
        await resp.write(_sse(chunk(None if chat else "", "length")))
        if p.include_usage:
            await resp.write(
                _sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": p.model,
                        "choices": [],
                        "usage": _usage(r, r.generated),
                    }
                )
            )
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# ----------------------------------------------------------------- app

AGENT_KEY = web.AppKey("agent", Agent)
#: the agent token (RADIXFLEET_AGENT_TOKEN): engine_config, tenant signatures
AUTH_KEY = web.AppKey("auth", BearerAuth)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
#: the running Reporter, or None without --router
REPORTER_KEY: web.AppKey[Reporter | None] = web.AppKey("reporter")


class _Traces:
    """Where the agent's spans go (radixfleet.common.tracing), or None: off. Set before the
    app serves (given, or made by its lifecycle) and cleared when it stops."""

    __slots__ = ("tracing",)

    def __init__(self, tracing: Tracing | None) -> None:
        self.tracing = tracing


TRACING_KEY = web.AppKey("tracing", _Traces)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as exc:
        agent = request.app[AGENT_KEY]
        agent.bad_requests += 1
        log.debug("bad request %s: %s", request.path, exc.message)
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": retry_after_header(exc.retry_after_s)}
        return web.json_response(exc.to_json(), status=exc.status, headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = RequestError(exc.reason or "error")
        body = err.to_json()
        body["error"]["code"] = exc.reason.lower().replace(" ", "_") if exc.reason else "error"
        if exc.status == 404:
            body["error"]["message"] = f"no route for {request.method} {request.path}"
            body["error"]["type"] = "not_found_error"
        headers = {"Retry-After": exc.headers.get("Retry-After", "1")} if exc.status in (429, 503) else None
        return web.json_response(body, status=exc.status, headers=headers)


def _handler(endpoint: Endpoint):
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _serve(request.app[AGENT_KEY], request, endpoint)

    return handle


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


def _server_info(agent: Agent) -> dict:
    cfg = agent.cfg
    return {
        # no model_path / tokenizer_path: SGLang's router would try to fetch a tokenizer
        # named by them (from HuggingFace, off loopback); the sim has no such files
        "served_model_name": cfg.name,
        "engine": "sim",
        "version": "radixfleet-sim-0.1",
        "gpu": cfg.gpu,
        "model_preset": cfg.model,
        "tp_size": cfg.tp,
        "dp_size": 1,
        "page_size": cfg.page_size,
        "max_total_num_tokens": agent.capacity,
        "chunked_prefill_size": cfg.scheduler.chunk_tokens,
        "max_running_requests": cfg.scheduler.max_running,
        "schedule_policy": cfg.scheduler.order,
        "admission": cfg.admission.mode,
        "block_bytes": cfg.block_bytes,
        "worker_id": cfg.worker_id,
        "disable_radix_cache": cfg.disable_radix_cache,
        "dram_tokens": cfg.dram.capacity_tokens if cfg.dram else 0,
        "kv_link": cfg.kv_link,
        "fingerprint": list(agent.fingerprint),
        "internal_states": [{"last_gen_throughput": 0.0}],
    }


async def _get_server_info(request: web.Request) -> web.Response:
    info = _server_info(request.app[AGENT_KEY])
    reporter = request.app.get(REPORTER_KEY)
    if reporter is not None:
        # each router link's state; "refused" says why a router turned registration
        # down (e.g. block_bytes_mismatch), so a silent misconfiguration shows here
        info["routers"] = [
            {
                "url": link.base,
                "state": link.state.value,
                "refused": link.refused,
                "sent_batches": link.sent_batches,
            }
            for link in reporter.links
        ]
        if reporter.bus is not None:
            b = reporter.bus
            info["bus"] = {
                "url": b.conn.url,
                "state": b.conn.state.value,
                "link": b.link.state.value,
                "sent_batches": b.link.sent_batches,
                "snapshots": b.link.snapshots,
            }
    return web.json_response(info)


async def _get_model_info(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    # see _server_info for why there is no model_path
    return web.json_response(
        {
            "served_model_name": agent.cfg.name,
            "model_name": agent.cfg.name,
            "is_generation": True,
            "engine": "sim",
        }
    )


async def _get_load(request: web.Request) -> web.Response:
    load = request.app[AGENT_KEY].sched.load()
    return web.json_response(
        [
            {
                "dp_rank": 0,
                "num_reqs": load.running_requests + load.queued_requests,
                "num_waiting_reqs": load.queued_requests,
                "num_tokens": load.kv_used_tokens,
            }
        ]
    )


async def _flush_cache(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    if agent.cache.flush():
        if agent.sched.dram is not None:  # every tier, as SGLang's flush does
            agent.sched.dram.clear()
        return web.Response(text="Cache flushed.\n")
    raise RequestError(
        f"cache not flushed: {agent.cache.locked_tokens} tokens are in use by "
        f"running requests; retry when idle"
    )


async def _engine_config(request: web.Request) -> web.Response:
    """``POST /internal/v1/engine_config {"rope_scaling": ...}``: adopt new engine
    settings. A different configuration fingerprint makes every cached KV wrong, so
    the tree is flushed (routers get ``cleared``); refused while requests run."""
    agent = request.app[AGENT_KEY]
    request.app[AUTH_KEY].check(request.headers.get("Authorization"))
    body = jsonbody.loads(await request.read())
    if not isinstance(body, dict) or "rope_scaling" not in body:
        raise MalformedRequest(
            "body must be an object with 'rope_scaling' (null for none)", param="rope_scaling"
        )
    rope = body["rope_scaling"]
    rope = None if rope is None else json.dumps(rope, sort_keys=True, separators=(",", ":"))
    fp = (agent.cfg.model, agent.cfg.tp, rope)
    try:
        flushed = agent.cache.set_fingerprint(fp)
    except RuntimeError as exc:
        raise RequestError(str(exc)) from None
    if flushed and agent.sched.dram is not None:  # the DRAM copies are as wrong
        agent.sched.dram.clear()
    agent.fingerprint = fp
    agent.cfg.rope_scaling = rope
    return web.json_response({"flushed": flushed, "fingerprint": list(fp)})


async def _models(request: web.Request) -> web.Response:
    """The served model, without ``max_model_len``: the agent enforces no context
    length (its one limit is the KV pool, prompt + max_tokens within
    ``max_total_num_tokens`` at ``/server_info``), and the pool's size is not one."""
    agent = request.app[AGENT_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": agent.cfg.name,
                    "object": "model",
                    "created": int(agent.started_at),
                    "owned_by": "radixfleet",
                    "root": agent.cfg.name,
                }
            ],
        }
    )


class _Collector:
    """Reads the agent's state at scrape time (no per-request metric updates)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def describe(self):
        return []

    def collect(self):
        a = self.agent
        s, cs, pool = a.sched.stats, a.cache.stats, a.pool
        lbl = ["model_name"]
        val = [a.cfg.name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(val, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(val, v)
            return c

        load = a.sched.load()
        yield gauge("sglang:num_queue_reqs", "Requests waiting in the queue.", load.queued_requests)
        yield gauge(
            "sglang:num_running_reqs", "Requests admitted (prefilling or decoding).", load.running_requests
        )
        yield gauge("sglang:token_usage", "Share of the KV pool in use.", pool.used / pool.capacity)
        yield gauge(
            "sglang:cache_hit_rate",
            "Cached prompt tokens / prompt tokens.",
            s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        )
        yield counter("sglang:prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("sglang:generation_tokens", "Generated tokens.", s.decode_tokens)
        yield counter("sglang:cached_tokens", "Prompt tokens served from the radix cache.", s.cached_tokens)
        yield counter(
            "radixfleet_agent_prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens
        )
        yield counter(
            "radixfleet_agent_cached_tokens", "Prompt tokens served from the radix cache.", s.cached_tokens
        )
        yield counter("radixfleet_agent_prefill_tokens", "Prompt tokens computed.", s.prefill_tokens)
        yield counter(
            "radixfleet_agent_dram_cached_tokens",
            "Prompt tokens read back from the DRAM tier (part of cached_tokens).",
            s.dram_cached_tokens,
        )
        yield counter(
            "radixfleet_agent_evicted_tokens", "Tokens evicted from the radix cache.", cs.evicted_tokens
        )
        yield counter(
            "radixfleet_agent_admission_refusals", "Insertions cut short by admission control.", cs.refusals
        )
        yield counter(
            "radixfleet_agent_admission_refused_tokens",
            "Tokens admission control kept out of the cache.",
            cs.refused_tokens,
        )
        yield counter(
            "radixfleet_agent_remote_decode_prefills",
            "Prefills answered with kv_transfer_params for a remote decode.",
            a.remote_decode_prefills,
        )
        yield counter(
            "radixfleet_agent_kv_transfers_in",
            "Requests that pulled a remote prefill's KV instead of computing it.",
            s.kv_transfers_in,
        )
        yield counter(
            "radixfleet_agent_kv_transferred_in_tokens",
            "Prompt tokens whose KV came from a remote prefill (not in cached_tokens).",
            s.kv_transferred_in_tokens,
        )
        yield counter(
            "radixfleet_agent_kv_transferred_in_bytes",
            "KV bytes pulled from remote prefills (CostModel.kv_transfer_bytes).",
            s.kv_transferred_in_bytes,
        )
        yield counter("radixfleet_agent_requests_finished", "Requests finished.", s.finished)
        yield counter("radixfleet_agent_requests_cancelled", "Requests cancelled.", s.cancelled)
        yield counter("radixfleet_agent_bad_requests", "Requests answered with a 4xx.", a.bad_requests)
        yield gauge("radixfleet_agent_kv_capacity_tokens", "KV pool size.", pool.capacity)
        yield gauge("radixfleet_agent_kv_used_tokens", "KV tokens in use (tree + running).", pool.used)
        yield gauge("radixfleet_agent_kv_cached_tokens", "Tokens in the radix tree.", a.cache.total_tokens)
        yield gauge(
            "radixfleet_agent_prefill_tokens_per_second",
            "Measured prefill rate.",
            a.sched.prefill_tokens_per_s(),
        )


class _TracingCollector:
    """The agent's span counters (radixfleet.common.tracing), while it traces."""

    def __init__(self, traces: _Traces) -> None:
        self.traces = traces

    def describe(self):
        return []

    def collect(self):
        t = self.traces.tracing
        if t is None:
            return
        st = t.stats()
        c = CounterMetricFamily(
            "radixfleet_agent_tracing_spans", "Trace spans by outcome", labels=["outcome"]
        )
        for outcome in ("exported", "dropped_queue_full", "dropped_export_failed"):
            c.add_metric([outcome], st[outcome])
        yield c


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(agent_spec())


async def _metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(
    cfg: AgentConfig,
    *,
    routers: list[str] | None = None,
    advertise_url: str | None = None,
    bus: str | None = None,
    bus_prefix: str = "radixfleet",
    bus_snapshot_interval_s: float = 30.0,
    bus_credentials=None,
    tracing: Tracing | None = None,
) -> web.Application:
    """The agent's aiohttp app; the engine (and reporter, given routers or a bus URL)
    live in its cleanup context, so they start and stop with the app.
    ``bus_credentials``: the NATS server's (``radixfleet.common.bus_connection.BusCredentials``).
    ``tracing``: where its spans go (its owner closes it); by default the OTLP
    exporter of ``cfg.otlp_traces_endpoint``, when set, opened and closed with the app."""
    agent = Agent(cfg, record_events=bool(routers) or bool(bus))
    agent.advertise_url = advertise_url
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app[AGENT_KEY] = agent
    app[AUTH_KEY] = BearerAuth("RADIXFLEET_AGENT_TOKEN", "agent")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(agent))
    standard_collectors(registry)
    app[REGISTRY_KEY] = registry
    traces = app[TRACING_KEY] = _Traces(tracing)
    registry.register(_TracingCollector(traces))

    async def lifecycle(app: web.Application):
        own = None
        if traces.tracing is None and cfg.otlp_traces_endpoint:
            from radixfleet.common.tracing import Tracing  # the tracing extra (MissingExtra without it)

            own = traces.tracing = Tracing(
                service_name="radixfleet-agent",
                endpoint=cfg.otlp_traces_endpoint,
                attributes={"service.instance.id": agent.engine_id},
            )
        await agent.engine.start()
        reporter = None
        if routers or bus:
            from radixfleet_tools.agent.reporter import Reporter

            wid = agent.engine_id
            agent_bus = None
            if bus:
                from radixfleet.common.bus_connection import BusCredentials
                from radixfleet_tools.agent.bus import AgentBus

                agent_bus = AgentBus(
                    bus,
                    worker_id=wid,
                    subject_prefix=bus_prefix,
                    snapshot_interval_s=bus_snapshot_interval_s,
                    registry=registry,
                    token=os.environ.get("RADIXFLEET_AGENT_TOKEN", ""),
                    credentials=bus_credentials or BusCredentials(),
                )
            reporter = Reporter(
                routers or [],
                worker_id=wid,
                url=advertise_url or "",
                models=[cfg.name],
                cache=agent.cache,
                load=agent.sched.load,
                token=os.environ.get("RADIXFLEET_AGENT_TOKEN"),
                block_bytes=cfg.block_bytes,
                role=cfg.role,
                scheduling_policy=cfg.scheduler.order,
                bus=agent_bus,
                dram=agent.sched.dram,
            )
            await reporter.start()
        app[REPORTER_KEY] = reporter
        try:
            yield
        finally:
            if reporter is not None:
                await reporter.aclose()
            await agent.engine.aclose()
            if own is not None:
                traces.tracing = None
                await own.aclose()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_post("/v1/completions", _handler(Endpoint.COMPLETIONS))
    r.add_post("/v1/chat/completions", _handler(Endpoint.CHAT))
    r.add_post("/generate", _handler(Endpoint.GENERATE))
    r.add_get("/v1/models", _models)
    for path in ("/health", "/health_generate"):
        r.add_get(path, _health)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, _get_server_info)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, _get_model_info)
    r.add_get("/get_load", _get_load)
    r.add_route("*", "/flush_cache", _flush_cache)
    r.add_get("/metrics", _metrics)
    r.add_post("/internal/v1/engine_config", _engine_config)
    r.add_get("/openapi.json", _openapi)
    return app
