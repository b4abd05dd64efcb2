"""Not tests: a fake router for the agent tests (records registrations and event batches,
applies them to a per-worker model of held blocks, and answers 409/404 on demand."""

from __future__ import annotations

from aiohttp import web

from radixfleet.wire.events import EVENTS_PATH, REGISTER_PATH, Cleared, Removed, Snapshot, Stored, parse_batch


class FakeRouter:
    def __init__(self) -> None:
        self.registrations: list[dict] = []
        self.batches: list = []
        self.auth: list[str | None] = []
        #: worker id -> {hash: parent}
        self.held: dict[str, dict] = {}
        #: next answers to give instead of 200: e.g. [409] or [404]
        self.answers: list[int] = []
        #: indices into ``batches`` of the batches answered with 409/404
        self.refused: list[int] = []
        self.app = web.Application()
        self.app.router.add_post(REGISTER_PATH, self._register)
        self.app.router.add_post(EVENTS_PATH, self._events)
        self.runner: web.AppRunner | None = None

    async def start(self, port: int) -> None:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _register(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        self.registrations.append(await request.json())
        return web.json_response({"status": "ok"})

    async def _events(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        batch = parse_batch(await request.json())
        self.batches.append(batch)
        if self.answers:
            code = self.answers.pop(0)
            self.refused.append(len(self.batches) - 1)
            status = {409: "snapshot_required", 404: "unknown_worker"}[code]
            return web.json_response({"status": status}, status=code)
        held = self.held.setdefault(batch.worker_id, {})
        for ev in batch.events:
            if isinstance(ev, Snapshot):
                held.clear()
                for h, p in ev.blocks:
                    assert p is None or p in held, "snapshot parent must come first"
                    held[h] = p
            elif isinstance(ev, Stored):
                p = ev.parent
                for h in ev.hashes:
                    held[h] = p
                    p = h
            elif isinstance(ev, Removed):
                for h in ev.hashes:
                    held.pop(h, None)
            elif isinstance(ev, Cleared):
                held.clear()
        return web.json_response({"status": "ok"})
