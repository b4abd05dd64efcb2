"""A fake data-parallel vLLM (HTTP plus one ZMQ KV-event publisher per rank) and its
prompts, for event-source and tokenizer-discovery tests."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from radixfleet.engines.token_keys import TokenKeyer
from radixfleet.engines.zmq_events import END_SEQ
from radixfleet.keys import Endpoint
from tests.engines.fake_engine import FakeEngine

BS = 16


MODEL = "tiny-dp"

#: vLLM 0.32's /metrics page (recorded), its block size made this fake's
METRICS_PAGE = (
    (Path(__file__).parents[1] / "data" / "vllm_metrics.txt")
    .read_text()
    .replace('block_size="32"', f'block_size="{BS}"')
)


def _src(port, replay=None, **kw):
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": replay,
        "topic": "kv-events",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        **kw,
    }


class FakeDpVllm:
    """A vLLM server with ``ranks`` data-parallel engine cores: each rank its own
    prefix cache (FakeEngine) and PUB socket, ``X-data-parallel-rank`` choosing the
    rank (none: vLLM's balancer, here in turn), a rank it does not have refused with
    vLLM's 400. ``sources`` is what ``/kv_event_sources`` answers (status, body)."""

    def __init__(self, keyer: TokenKeyer, ranks: int = 2, *, replay_delay_s: float | None = None) -> None:
        self.keyer = keyer
        self.ctx = zmq.asyncio.Context()
        self.engines, self.pubs, self.ports, self.seqs = [], [], [], []
        self.replays, self.replay_ports, self.sent = [], [], []
        self.replay_delay_s = replay_delay_s  # None: no replay endpoint
        self._replay_tasks = []
        for _r in range(ranks):
            pub = self.ctx.socket(zmq.PUB)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            self.engines.append(FakeEngine(capacity=256, bs=BS))
            self.pubs.append(pub)
            self.ports.append(port)
            self.seqs.append(0)
            self.sent.append([])  # (seq, payload) published: what a replay answers
            if replay_delay_s is not None:
                rep = self.ctx.socket(zmq.ROUTER)
                self.replay_ports.append(rep.bind_to_random_port("tcp://127.0.0.1"))
                self.replays.append(rep)
        self.ranks = ranks
        self.sources = (
            200,
            json.dumps(
                {
                    str(r): _src(p, f"tcp://*:{self.replay_ports[r]}" if self.replay_ports else None)
                    for r, p in enumerate(self.ports)
                }
            ),
        )
        self.headers: list[str | None] = []  # X-data-parallel-rank of each request
        self._turn = 0
        #: /v1/models' root (vLLM's --model; None: left out of the answer)
        self.root: str | None = None
        #: who answers POST /tokenize (None: 404, a server without it)
        self.tokenize_keyer: TokenKeyer | None = keyer
        self.start_time = 1.7e9  # /metrics' process_start_time_seconds

    def restart(self, root: str | None, keyer: TokenKeyer) -> None:
        """A new engine process serving another model: its caches empty, ``keyer`` its
        tokenizer, ``root`` its folder, a new start time on /metrics."""
        self.root = root
        self.keyer = self.tokenize_keyer = keyer
        for eng in self.engines:
            eng.clear()
        self.start_time += 100.0

    def start_replay(self) -> None:
        """Serves each rank's replay (vLLM's framing), answering ``replay_delay_s``
        late: a busy engine core."""

        async def serve(r):
            rep = self.replays[r]
            while True:
                ident, _, start = await rep.recv_multipart()
                await asyncio.sleep(self.replay_delay_s)
                for seq, payload in list(self.sent[r]):
                    if seq >= int.from_bytes(start, "big"):
                        await rep.send_multipart([ident, b"", b"kv-events", seq.to_bytes(8, "big"), payload])
                await rep.send_multipart([ident, b"", b"", END_SEQ, b""])

        self._replay_tasks = [asyncio.create_task(serve(r)) for r in range(len(self.replays))]

    def publish(self, rank: int, events) -> None:
        payload = msgpack.packb([time.time(), events, rank])
        seq = self.seqs[rank]
        self.sent[rank].append((seq, payload))
        self.pubs[rank].send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        self.seqs[rank] += 1

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        h = request.headers.get("X-data-parallel-rank")
        self.headers.append(h)
        if h is None:
            rank, self._turn = self._turn, (self._turn + 1) % self.ranks
        else:
            rank = int(h)
            if not 0 <= rank < self.ranks:
                return web.json_response(
                    {
                        "error": {
                            "message": f"data_parallel_rank {rank} is out of range [0, {self.ranks}).",
                            "type": "BadRequestError",
                            "param": None,
                            "code": 400,
                        }
                    },
                    status=400,
                )
        ids = list(self.keyer.token_ids(Endpoint.COMPLETIONS, body)[0])
        eng = self.engines[rank]
        hit = 0
        parent = None
        for i in range(len(ids) // BS):
            e = eng._ehash(parent, ids[i * BS : (i + 1) * BS], "")
            if e not in eng.blocks:
                break
            hit, parent = hit + BS, e
        hit = min(hit, (len(ids) - 1) // BS * BS)
        events = eng.run(ids)
        if events:
            self.publish(rank, events)
        return web.json_response(
            {
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": 1,
                    "total_tokens": len(ids) + 1,
                    "prompt_tokens_details": {"cached_tokens": hit},
                },
            }
        )

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        status, body = self.sources
        return web.Response(status=status, text=body, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "owned_by": "vllm", "parent": None}
        if self.root is not None:
            card["root"] = self.root
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt (special tokens added) or messages (the chat
        template), by the engine's own tokenizer."""
        if self.tokenize_keyer is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        chat = "messages" in body
        ids = self.tokenize_keyer.token_ids(Endpoint.CHAT if chat else Endpoint.COMPLETIONS, body)[0]
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": list(ids)})

    async def metrics(self, request: web.Request) -> web.Response:
        page = METRICS_PAGE.replace(
            "process_start_time_seconds 1.79629055725e+09", f"process_start_time_seconds {self.start_time}"
        )
        return web.Response(text=page, content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/metrics", self.metrics)
        return app

    def close(self) -> None:
        for t in self._replay_tasks:
            t.cancel()
        for p in self.pubs + self.replays:
            p.close(0)
        self.ctx.term()


WORDS = ["cache", "prefix", "token", "router", "worker", "engine", "request", "model", "block", "hash"]


def prompt(seed: int, words: int = 200) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))
