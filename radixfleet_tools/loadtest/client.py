"""An async streaming client for OpenAI-compatible targets, measuring what users feel.

One ``Target`` per router (ours, SGLang's ``smg``, or an agent directly). Per request
it records a ``Result``: time to first token, the gaps between later tokens, end to
end, prompt / cached / output tokens from the final usage chunk (it always sends
``stream_options.include_usage``), the worker that served it (response header
``x-radixfleet-worker``), the router's routing quality for it (the best match among
the eligible workers and the chosen worker's, response headers
``x-radixfleet-available-tokens`` and ``x-radixfleet-predicted-tokens`` where the
router has ``response_headers.match_tokens`` on: radixfleet.route.decisions), the HTTP status,
the retries its refusals cost (``radixfleet_tools.loadtest.retry``: 429/503 with ``Retry-After`` are retried
as the OpenAI SDK
does, by default) and, on failure, an error kind::

    connect     the target refused or dropped the connection before answering
    timeout     no complete answer within the request timeout
    http_<NNN>  the target answered with an HTTP error status (after the retries
                the policy allows)
    stream      the stream broke off or carried an error event
    protocol    the answer was not the OpenAI streaming shape
    cancelled   still running when the run's drain grace ran out

Lifecycle: ``async with Target(...) as t`` (or ``await t.start()`` / ``await
t.aclose()``, idempotent); ``await t.probe()`` raises ``ConfigError`` up front when
the target is unreachable or is not an OpenAI-compatible server. ``headers`` go
with every request, the probe included (``Authorization: Bearer <api key>``, a
tenant header).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import time
from dataclasses import dataclass, field

import aiohttp

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.loadtest.retry import RetryPolicy
from radixfleet_tools.loadtest.workloads import API_CHAT, RequestSpec

log = logging.getLogger(__name__)

WORKER_HEADER = "x-radixfleet-worker"
AVAILABLE_HEADER = "x-radixfleet-available-tokens"
PREDICTED_HEADER = "x-radixfleet-predicted-tokens"


@dataclass(slots=True)
class Result:
    """What one request did. Times are seconds; ``start`` is on the run's clock."""

    id: str
    session: str
    turn: int
    start: float = 0.0
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    #: gaps between consecutive streamed tokens after the first
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None
    #: the router's best match among the eligible workers and the chosen worker's, in
    #: tokens (None: the target did not say: ``response_headers.match_tokens`` off)
    available_tokens: int | None = None
    predicted_tokens: int | None = None
    #: HTTP status of the last attempt (None: no answer)
    status: int | None = None
    #: attempts beyond the first, and the seconds spent waiting before them
    retries: int = 0
    retry_wait_s: float = 0.0
    #: the prompt's tokens as the load generator counts them (oracle / pooled basis)
    est_prompt_tokens: int = 0
    #: leading tokens an unbounded single cache held when it was sent
    oracle_cached: int = 0
    #: leading tokens one LRU cache of the fleet's capacity held when it was sent
    pooled_cached: int = 0
    #: the status ``POST /v1/prefetch`` answered for it (None: none sent), and
    #: whether the router found the prefix there already (``deduplicated``; None:
    #: it did not say, as it does not to a client without a tenant: radixfleet.server.prefetch)
    prefetch_status: int | None = None
    prefetch_dedup: bool | None = None


class _State(enum.Enum):
    NEW = "new"  # constructed; start() opens the session
    OPEN = "open"  # session open: send() allowed
    CLOSED = "closed"  # aclose() ran; final


class Target:
    """An OpenAI-compatible endpoint (``base_url`` without ``/v1``). ``base_url`` may
    list several comma-separated URLs (router replicas): requests then go to them in
    client-side round robin, and ``base_url`` is the first (probes, admin calls).

    ``retry`` defaults to none here, so benchmarks built on ``Target`` count every
    refusal as it came; ``radixfleet loadtest`` passes the OpenAI SDK's policy (its
    ``--retry`` default)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        model: str | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        ignore_eos: bool = True,
        send_session: bool = False,
        max_connections: int = 2048,
        headers: dict[str, str] | None = None,
        retry: RetryPolicy = RetryPolicy("none"),
        seed: int = 0,
        prefetch: bool | None = None,
    ) -> None:
        self.name = name
        urls = []
        for u in base_url.split(","):
            u = u.strip().rstrip("/")
            urls.append(u[:-3] if u.endswith("/v1") else u)
        self.base_urls = urls
        self.base_url = urls[0]
        self._rr = 0
        self.model = model  # None: the first of GET /v1/models (probe())
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.ignore_eos = ignore_eos  # ask for exactly max_tokens (SGLang/vLLM extension)
        self.send_session = send_session  # put the session id in the 'user' field
        self.max_connections = max_connections
        self.headers = dict(headers or {})  # sent with every request, the probe included
        self.retry = retry
        #: a spec's lead (``RequestSpec.lead_s``): None ignores it (sent at arrival);
        #: False waits it out; True also posts its known prefix to /v1/prefetch first
        self.prefetch = prefetch
        self._jitter = random.Random(seed)  # backoff jitter: the same run waits the same
        self._session: aiohttp.ClientSession | None = None
        self._state = _State.NEW

    async def start(self) -> Target:
        if self._state is _State.CLOSED:
            raise RuntimeError("Target is closed; create a new one")
        if self._state is _State.NEW:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=self.max_connections, force_close=False),
            )
            self._state = _State.OPEN
        return self

    async def aclose(self) -> None:
        if self._state is _State.OPEN and self._session is not None:
            await self._session.close()
        self._state = _State.CLOSED

    async def __aenter__(self) -> Target:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _need_open(self) -> aiohttp.ClientSession:
        if self._state is not _State.OPEN:
            raise RuntimeError("call start() (or use 'async with') before sending")
        assert self._session is not None, "an open client has its session"
        return self._session

    async def probe(self) -> str:
        """Checks the target answers ``GET /v1/models``; returns the model to use.

        Raises ``ConfigError`` (path ``--target NAME``) with the reason otherwise.
        """
        session = self._need_open()
        where = f"--target {self.name}"
        try:
            async with session.get(
                f"{self.base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    hint = " (pass --api-key KEY or set OPENAI_API_KEY)" if resp.status in (401, 403) else ""
                    raise ConfigError(where, f"{self.base_url}/v1/models answered HTTP {resp.status}{hint}")
                body = await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise ConfigError(
                where, f"{self.base_url} is unreachable ({exc.__class__.__name__}: {exc})"
            ) from None
        except asyncio.TimeoutError:
            raise ConfigError(where, f"{self.base_url} did not answer within 10 s") from None
        except ValueError:
            raise ConfigError(where, f"{self.base_url}/v1/models did not answer JSON") from None
        if self.model is None:
            try:
                self.model = body["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise ConfigError(where, f"{self.base_url}/v1/models lists no model; pass --model") from None
        return self.model

    def _request(self, spec: RequestSpec) -> tuple[str, dict]:
        body = dict(spec.body)
        body.update(
            model=self.model or "default",
            max_tokens=spec.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
        )
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.send_session:
            body["user"] = spec.session
        path = "/v1/chat/completions" if spec.api == API_CHAT else "/v1/completions"
        urls = self.base_urls
        base = urls[self._rr % len(urls)]
        self._rr += 1
        return base + path, body

    async def send(self, spec: RequestSpec, result: Result, clock=time.monotonic) -> str | None:
        """Sends one streaming request, filling ``result``; returns the answer text.

        Never raises for a failed request (the kind goes in ``result.error_kind``);
        re-raises ``CancelledError`` after marking the result cancelled.
        """
        session = self._need_open()
        url, body = self._request(spec)
        if spec.lead_s is not None and self.prefetch is not None:
            await self._lead(session, url, spec, result, clock)
        t0 = clock()
        result.start = t0
        parts: list[str] = []
        try:
            while True:
                async with session.post(url, json=body) as resp:
                    result.worker = resp.headers.get(WORKER_HEADER)
                    result.available_tokens = _tokens(resp.headers.get(AVAILABLE_HEADER))
                    result.predicted_tokens = _tokens(resp.headers.get(PREDICTED_HEADER))
                    result.status = resp.status
                    if resp.status == 200:
                        if not await _read_stream(resp, spec.api, result, parts, t0, clock):
                            return None
                        break
                    text = (await resp.text())[:300]
                    if not self.retry.should_retry(resp.status, resp.headers, result.retries):
                        _fail(result, f"http_{resp.status}", _error_message(text))
                        return None
                    wait = self.retry.delay_s(resp.headers, result.retries, self._jitter)
                result.retries += 1
                result.retry_wait_s += wait
                await asyncio.sleep(wait)
        except asyncio.CancelledError:
            _fail(result, "cancelled", "still in flight at the end of the drain grace")
            raise
        except asyncio.TimeoutError:
            _fail(result, "timeout", f"no complete answer within {self.timeout.total} s")
            return None
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            kind = "connect" if result.ttft_s is None else "stream"
            _fail(result, kind, f"{exc.__class__.__name__}: {exc}")
            return None
        except aiohttp.ClientError as exc:
            _fail(result, "stream", f"{exc.__class__.__name__}: {exc}")
            return None
        if result.ttft_s is None:
            _fail(result, "protocol", "the stream carried no tokens")
            return None
        result.e2e_s = clock() - t0
        if not result.output_tokens:
            result.output_tokens = len(parts)
        result.ok = True
        return "".join(parts)

    async def _lead(self, session: aiohttp.ClientSession, url: str, spec: RequestSpec, result: Result, clock):
        """The retriever's lead before a request is due: with prefetching on, its
        known prefix goes to ``POST /v1/prefetch`` (the router answers 202 at once;
        a refusal or failure costs the request nothing), then the rest of the lead
        is waited out."""
        assert spec.lead_s is not None, "only a spec with a lead waits"
        t = clock()
        if self.prefetch and spec.prefetch is not None:
            pre = {**spec.prefetch, "model": self.model or "default", "max_tokens": spec.max_tokens}
            if self.send_session:
                pre["user"] = spec.session
            base = url[: url.index("/v1/")]
            try:
                async with session.post(
                    base + "/v1/prefetch", json=pre, timeout=aiohttp.ClientTimeout(total=spec.lead_s + 5)
                ) as resp:
                    result.prefetch_status = resp.status
                    if resp.status == 202:
                        dedup = (await resp.json(content_type=None)).get("deduplicated")
                        result.prefetch_dedup = dedup if isinstance(dedup, bool) else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
                result.prefetch_status = 0
        rest = spec.lead_s - (clock() - t)
        if rest > 0:
            await asyncio.sleep(rest)


async def _read_stream(
    resp: aiohttp.ClientResponse, api: str, result: Result, parts: list[str], t0: float, clock
) -> bool:
    """Reads an SSE answer into ``result`` (token times, usage) and ``parts`` (the
    text chunks); False after marking ``result`` failed when the stream is bad."""
    last_tok: float | None = None
    buf = b""
    async for raw in resp.content.iter_any():  # one await per read, not one per line
        buf += raw
        cut = buf.rfind(b"\n")
        if cut < 0:
            continue
        # every whole line now (its tokens timed on arrival), the partial tail kept
        lines, buf = buf[:cut], buf[cut + 1 :]
        for line in lines.splitlines():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            try:
                chunk = json.loads(data)
            except ValueError:
                _fail(result, "protocol", f"bad SSE data: {data[:80]!r}")
                return False
            if "error" in chunk:
                _fail(result, "stream", _error_message(json.dumps(chunk)))
                return False
            text = _chunk_text(chunk, api)
            if text:
                now = clock()
                if last_tok is None:
                    result.ttft_s = now - t0
                else:
                    result.itl_s.append(now - last_tok)
                last_tok = now
                parts.append(text)
            usage = chunk.get("usage")
            if usage:
                _read_usage(result, usage)
    _fail(result, "stream", "stream ended without [DONE]")
    return False


def _chunk_text(chunk: dict, api: str) -> str:
    choices = chunk.get("choices") or ()
    if not choices:
        return ""
    c = choices[0]
    if api == API_CHAT:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def _read_usage(result: Result, usage: dict) -> None:
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens") or 0)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _fail(result: Result, kind: str, message: str) -> None:
    result.ok = False
    result.error_kind = kind
    result.error = message
    return None


def _tokens(v: str | None) -> int | None:
    """A token count a response header gives (None: absent or not a count)."""
    return int(v) if v is not None and v.isascii() and v.isdigit() and len(v) <= 12 else None
