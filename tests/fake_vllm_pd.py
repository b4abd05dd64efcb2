"""A fake vLLM prefill/decode pair, faithful to vLLM's disaggregated protocol
(its NIXL/P2P connectors' ``kv_transfer_params`` as the serving proxy drives them).

Prefill side: refuses a request that does not ask ``do_remote_decode`` with
``max_tokens: 1`` and ``stream: false``; answers one token and
``kv_transfer_params`` naming where its KV is (``do_remote_prefill: true``, its
engine id, the blocks it holds, its host and port), holding those blocks for a
remote decode. Decode side: a request with ``do_remote_prefill`` must name a
prefill engine and blocks it holds (else 400, as a failed KV pull would be an
error); the prompt then counts as cached (``usage.prompt_tokens_details``). A
request without params is prefilled locally (nothing cached).

Each app's ``state`` records what it saw; ``mode`` makes it misbehave: ``fail``
(500), ``break`` (stream one chunk, then drop the connection), ``slow`` (wait
``delay_s`` before answering, noting a client that hung up)."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BLOCK = 16  # tokens per KV block
MODEL = "m"


@dataclass
class FakeState:
    name: str
    role: str  # prefill | decode
    port: int = 0
    mode: str = ""
    delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    hung_up: int = 0  # requests whose client left while this worker held them
    #: SGLang's protocol instead of vLLM's; its prefill side's bootstrap port
    sglang: bool = False
    bootstrap_port: int = 0
    #: request id -> block ids held for a remote decode (prefill side)
    held: dict[str, list[int]] = field(default_factory=dict)


_ids = itertools.count(1)
#: every prefill engine's held blocks, by engine id (what a decode pull reads)
REGISTRY: dict[str, FakeState] = {}
#: SGLang bootstrap rooms a prefill leg opened: room -> (prefill name, (host, port))
ROOMS: dict[int, tuple[str, tuple[Any, Any]]] = {}


def _tokens(body: dict) -> int:
    p = body.get("prompt", "")
    if not isinstance(p, str):
        p = json.dumps(body.get("messages", ""))
    return max(1, len(p) // 4)


async def _wait(request: web.Request, st: FakeState) -> bool:
    """Waits ``delay_s``; False when the client hung up meanwhile."""
    end = asyncio.get_running_loop().time() + st.delay_s
    while asyncio.get_running_loop().time() < end:
        t = request.transport
        if t is None or t.is_closing():
            st.hung_up += 1
            return False
        await asyncio.sleep(0.02)
    return True


def _err(status: int, message: str) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": "BadRequestError", "code": status}, status=status
    )


def fake_app(st: FakeState) -> web.Application:
    REGISTRY[st.name] = st

    async def complete(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        st.requests.append(body)
        if st.mode == "fail":
            return _err(500, "engine failure")
        if st.mode == "slow" and not await _wait(request, st):
            return web.Response(status=499)
        prompt = _tokens(body)
        params: dict[str, Any] | None = body.get("kv_transfer_params")
        if st.sglang:
            answer = await generate_sglang(request, body)
            if answer is not None:
                return answer
            params = None
        if st.sglang and st.role == "decode":
            cached = prompt
        elif st.role == "prefill":
            if not params or params.get("do_remote_decode") is not True:
                return _err(400, "prefill worker: kv_transfer_params.do_remote_decode required")
            if body.get("max_tokens") != 1 or body.get("stream") is not False:
                return _err(400, "prefill leg must be max_tokens 1, not streamed")
            rid = f"{st.name}-{next(_ids)}"
            blocks = list(range(next(_ids) * 100, next(_ids) * 100 + (prompt + BLOCK - 1) // BLOCK))
            st.held[rid] = blocks
            return web.json_response(
                {
                    "id": rid,
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": "p", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1},
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_block_ids": blocks,
                        "remote_engine_id": st.name,
                        "remote_request_id": rid,
                        "remote_host": "127.0.0.1",
                        "remote_port": st.port,
                        "tp_size": 1,
                    },
                }
            )
        else:
            cached = 0
        if params:
            if not params.get("do_remote_prefill"):
                return _err(400, "decode worker: do_remote_prefill expected")
            src = REGISTRY.get(str(params.get("remote_engine_id")))
            held = src.held.pop(str(params.get("remote_request_id")), None) if src else None
            if held is None or held != params.get("remote_block_ids"):
                return _err(400, "decode worker: no such remote blocks")
            cached = prompt
        n = body.get("max_tokens") or 4
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "d",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": "d" * n, "finish_reason": "length"}],
                    "usage": usage,
                }
            )
        sr = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await sr.prepare(request)
        chunk = {
            "id": "d",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "d"}],
        }
        for _ in range(n):
            try:
                await sr.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            except ConnectionResetError:  # the router closed the leg
                st.hung_up += 1
                return sr
            if st.mode == "break":
                assert request.transport is not None
                request.transport.abort()
                return sr
            if st.delay_s and st.mode == "slow_stream":
                t = request.transport
                if t is None or t.is_closing():
                    st.hung_up += 1
                    return sr
                await asyncio.sleep(st.delay_s)
        so = body.get("stream_options") or {}
        if so.get("include_usage"):
            last = {"id": "d", "object": "text_completion", "model": MODEL, "choices": [], "usage": usage}
            await sr.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        await sr.write(b"data: [DONE]\n\n")
        await sr.write_eof()
        return sr

    async def generate_sglang(request: web.Request, body: dict) -> web.StreamResponse | None:
        """SGLang's protocol: both legs carry the same bootstrap room; the decode leg
        waits (bounded) for its prefill leg to have arrived at the named host:port."""
        room = body.get("bootstrap_room")
        where = (body.get("bootstrap_host"), body.get("bootstrap_port"))
        if type(room) is not int or None in where:
            return _err(400, "bootstrap_room, bootstrap_host and bootstrap_port required")
        if st.role == "prefill":
            ROOMS[room] = (st.name, where)
            return web.json_response({"id": "p", "choices": [{"index": 0, "text": "p"}]})
        for _ in range(100):
            if room in ROOMS:
                break
            await asyncio.sleep(0.02)
        src = ROOMS.pop(room, None)
        if src is None or REGISTRY[src[0]].bootstrap_port != where[1]:
            return _err(500, "KV bootstrap failed")
        return None

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
