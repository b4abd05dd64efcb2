"""A fake Kubernetes API server (aiohttp, loopback) that speaks the real list/watch
protocol for EndpointSlices, built from the published API shapes
(https://kubernetes.io/docs/reference/using-api/api-concepts/):

- ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices``: a list
  (``EndpointSliceList``, ``metadata.resourceVersion``), paginated with
  ``limit``/``continue`` over a consistent snapshot; ``labelSelector`` with the
  equality (``=``, ``==``, ``!=``) and set (``in``, ``notin``, ``k``, ``!k``) forms.
- ``?watch=true&resourceVersion=RV``: a chunked stream of JSON lines
  ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`` of every change
  after RV; ``allowWatchBookmarks=true`` adds BOOKMARKs carrying the current
  resourceVersion; ``timeoutSeconds`` ends the stream; a resourceVersion older
  than the compacted one gets an ERROR event with a 410 ``Expired`` Status, as the
  watch cache answers; an expired ``continue`` token gets HTTP 410.
- Bearer token authentication (401 Status otherwise).

Test controls (same process, same loop): ``put_slice``, ``delete_slice``,
``compact`` (older resourceVersions expire), ``expire_watches`` (send 410 to every
open watch), ``drop_watches`` (cut every watch connection mid-stream),
``inject`` (write a raw line to every watch), ``list_override`` (answer lists
with a fixed status and raw body). ``sent_at[rv]`` is the monotonic time the
event of resourceVersion ``rv`` was written to the watchers.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import re
import time
from typing import Any

from aiohttp import web

GROUP = "discovery.k8s.io/v1"
PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def make_slice(
    name: str,
    *,
    service: str,
    endpoints: list[tuple],
    port: int = 8000,
    port_name: str = "http",
    labels: dict | None = None,
    address_type: str = "IPv4",
) -> dict:
    """An EndpointSlice as the EndpointSlice controller writes it. ``endpoints``:
    ``(address, ready, pod_name)`` tuples (``ready`` None leaves it unset)."""
    eps = []
    for addr, ready, pod in endpoints:
        cond: dict[str, Any] = {
            "serving": bool(ready) if ready is not None else True,
            "terminating": ready is False,
        }
        if ready is not None:
            cond["ready"] = ready
        e: dict[str, Any] = {"addresses": [addr], "conditions": cond, "nodeName": "node-1"}
        if pod:
            e["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "", "uid": f"uid-{pod}"}
        eps.append(e)
    return {
        "kind": "EndpointSlice",
        "apiVersion": GROUP,
        "metadata": {
            "name": name,
            "generateName": f"{service}-",
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                **(labels or {}),
            },
        },
        "addressType": address_type,
        "endpoints": eps or None,
        "ports": [{"name": port_name, "protocol": "TCP", "port": port}],
    }


def make_pod(
    name: str,
    ip: str = "10.0.0.5",
    ready: bool = True,
    deleting: bool = False,
    rv: str = "7",
    labels: dict | None = None,
) -> dict:
    """A Pod as the API serves it, with what the InferencePool discovery reads: its
    name, labels, ``Ready`` condition, ``podIP`` (``""``: none yet) and, when
    ``deleting``, a ``deletionTimestamp``."""
    meta: dict[str, Any] = {
        "name": name,
        "resourceVersion": rv,
        "labels": labels if labels is not None else {"radixfleet.io/pool": "vllm"},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T12:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "status": status}


def _qbool(value: str | None) -> bool:
    """A query bool as the apiserver converts it (``Convert_Slice_string_To_bool``:
    case-insensitive, only 0/f/false are false; absent is false)."""
    return value is not None and value.lower() not in ("0", "f", "false")


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


_TERM = re.compile(
    r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*)|"
    r"\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


def selector_matches(selector: str, labels: dict) -> bool:
    """Kubernetes label selector semantics (comma = AND)."""
    if not selector:
        return True
    terms = re.split(r",(?![^()]*\))", selector)
    for term in terms:
        m = _TERM.match(term)
        if not m:
            raise ValueError(f"unable to parse requirement: {term!r}")
        neg, key, op, val, setop, vals = m.groups()
        have = key in labels
        if setop:
            options = {v.strip() for v in vals.split(",")}
            ok = (
                (have and labels[key] in options)
                if setop == "in"
                else (not have or labels[key] not in options)
            )
        elif op:
            ok = have and labels[key] == val if op in ("=", "==") else (not have or labels[key] != val)
        else:
            ok = have != bool(neg)
        if not ok:
            return False
    return True


class _Watcher:
    __slots__ = ("ns", "selector", "queue", "response")

    def __init__(self, ns: str, selector: str, response: web.StreamResponse) -> None:
        self.ns = ns
        self.selector = selector
        self.queue: asyncio.Queue = asyncio.Queue()
        self.response = response


class FakeKubeAPI:
    """The server. ``async with FakeKubeAPI(token) as api: api.url ...``."""

    def __init__(self, token: str = "test-token", *, bookmark_interval_s: float = 0.5) -> None:
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.rv = 100  # the store's resourceVersion (etcd revision)
        self.compacted = 0  # resourceVersions <= this have expired
        self.objects: dict[tuple[str, str], dict] = {}
        self.log: list[tuple[int, str, str, dict]] = []  # (rv, ns, type, object)
        self.watchers: set[_Watcher] = set()
        self.sent_at: dict[int, float] = {}
        self.requests: list[dict] = []  # query of every request, in order
        self.list_override: tuple[int, bytes] | None = None
        self._snapshots: dict[str, tuple[int, list[dict]]] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeKubeAPI:
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.drop_watches()
        await self._runner.cleanup()

    # ------------------------------------------------------------ controls

    def put_slice(self, ns: str, obj: dict) -> int:
        """Creates or replaces a slice; returns its new resourceVersion."""
        key = (ns, obj["metadata"]["name"])
        etype = "MODIFIED" if key in self.objects else "ADDED"
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = ns
        return self._commit(ns, etype, key, obj)

    def delete_slice(self, ns: str, name: str) -> int:
        obj = self.objects[(ns, name)]
        return self._commit(ns, "DELETED", (ns, name), obj)

    def compact(self) -> None:
        """Every resourceVersion up to now expires (etcd compaction)."""
        self.compacted = self.rv
        self.log.clear()

    def expire_watches(self) -> None:
        """Every open watch gets ERROR 410, as a watch cache that fell behind."""
        for w in list(self.watchers):
            w.queue.put_nowait(("error", _status(410, "Expired", "too old resource version")))
            self.watchers.discard(w)  # closed from now on: wait_watchers() waits for the next

    def drop_watches(self) -> None:
        """Cuts every watch connection without a clean end of stream."""
        for w in list(self.watchers):
            tr = w.response._req.transport if w.response._req is not None else None
            if tr is not None:
                tr.abort()
            w.queue.put_nowait(("stop", None))
            self.watchers.discard(w)

    async def wait_watchers(self, n: int = 1, timeout_s: float = 5.0) -> None:
        """Waits until ``n`` watches are open (a control applied before that would
        miss them)."""
        deadline = time.monotonic() + timeout_s
        while len(self.watchers) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.watchers)} watches open, expected {n}")
            await asyncio.sleep(0.005)

    def inject(self, raw: bytes) -> None:
        """Writes ``raw`` (a garbage line) to every open watch."""
        for w in list(self.watchers):
            w.queue.put_nowait(("raw", raw))

    # ------------------------------------------------------------ internals

    def _commit(self, ns: str, etype: str, key: tuple[str, str], obj: dict) -> int:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if etype == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.log.append((self.rv, ns, etype, obj))
        for w in list(self.watchers):
            if w.ns == ns and selector_matches(w.selector, obj["metadata"].get("labels", {})):
                w.queue.put_nowait(("event", (self.rv, etype, obj)))
        return self.rv

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        self.requests.append(dict(q))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        ns = request.match_info["ns"]
        selector = q.get("labelSelector", "")
        try:
            selector_matches(selector, {})
        except ValueError as exc:
            return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
        if _qbool(q.get("watch")):
            return await self._watch(request, ns, selector)
        return self._list(ns, selector, q)

    def _list(self, ns: str, selector: str, q) -> web.Response:
        if self.list_override is not None:
            status, raw = self.list_override
            return web.Response(status=status, body=raw, content_type="application/json")
        token = q.get("continue")
        if token:
            try:
                state = json.loads(base64.b64decode(token))
                rv, start = int(state["rv"]), int(state["start"])
                snap_rv, items = self._snapshots[state["id"]]
            except (ValueError, KeyError, TypeError):
                return web.json_response(_status(400, "BadRequest", "invalid continue"), status=400)
            if rv <= self.compacted:
                return web.json_response(_status(410, "Expired", "continue token expired"), status=410)
        else:
            items = sorted(
                (
                    copy.deepcopy(o)
                    for (n, _), o in self.objects.items()
                    if n == ns and selector_matches(selector, o["metadata"].get("labels", {}))
                ),
                key=lambda o: o["metadata"]["name"],
            )
            for o in items:  # list items carry neither kind nor apiVersion
                o.pop("kind", None)
                o.pop("apiVersion", None)
            snap_rv, start = self.rv, 0
            state = {"id": str(len(self._snapshots)), "rv": snap_rv}
            self._snapshots[state["id"]] = (snap_rv, items)
        limit = int(q.get("limit", "0") or 0)
        page = items[start : start + limit] if limit else items[start:]
        meta: dict[str, Any] = {"resourceVersion": str(snap_rv)}
        end = start + len(page)
        if end < len(items):
            meta["continue"] = base64.b64encode(json.dumps({**state, "start": end}).encode()).decode()
            meta["remainingItemCount"] = len(items) - end
        return web.json_response(
            {"kind": "EndpointSliceList", "apiVersion": GROUP, "metadata": meta, "items": page}
        )

    async def _watch(self, request: web.Request, ns: str, selector: str) -> web.StreamResponse:
        q = request.query
        rv_s = q.get("resourceVersion", "")
        timeout = float(q.get("timeoutSeconds", "1800"))
        bookmarks = _qbool(q.get("allowWatchBookmarks"))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        w = _Watcher(ns, selector, resp)

        async def send(obj: dict) -> None:
            await resp.write(json.dumps(obj).encode() + b"\n")

        try:
            if rv_s and int(rv_s) < self.compacted:
                await send(
                    {
                        "type": "ERROR",
                        "object": _status(
                            410, "Expired", f"too old resource version: {rv_s} ({self.compacted})"
                        ),
                    }
                )
                return resp
            self.watchers.add(w)
            if rv_s in ("", "0"):
                for (n, _), o in sorted(self.objects.items()):
                    if n == ns and selector_matches(selector, o["metadata"].get("labels", {})):
                        await send({"type": "ADDED", "object": o})
            else:
                for rv, n, etype, o in list(self.log):
                    if (
                        rv > int(rv_s)
                        and n == ns
                        and selector_matches(selector, o["metadata"].get("labels", {}))
                    ):
                        await send({"type": etype, "object": o})
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return resp
                try:
                    kind, item = await asyncio.wait_for(w.queue.get(), min(left, self.bookmark_interval_s))
                except asyncio.TimeoutError:
                    if bookmarks:
                        await send(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": "EndpointSlice",
                                    "apiVersion": GROUP,
                                    "metadata": {"resourceVersion": str(self.rv)},
                                },
                            }
                        )
                    continue
                if kind == "event":
                    rv, etype, o = item
                    await send({"type": etype, "object": o})
                    self.sent_at[rv] = time.monotonic()
                elif kind == "error":
                    await send({"type": "ERROR", "object": item})
                    return resp
                elif kind == "raw":
                    await resp.write(item)
                else:  # stop: the connection was cut
                    return resp
        except (ConnectionResetError, ConnectionError):
            return resp
        finally:
            self.watchers.discard(w)


class FakeResp:
    """A kubernetes_asyncio ``_preload_content=False`` answer (status, body or watch
    lines), for the InferencePool discovery's tests with no server."""

    def __init__(self, status: int, body=None, lines: asyncio.Queue | None = None) -> None:
        self.status = status
        self._body = json.dumps(body).encode()
        self.content = self
        self._lines = lines

    async def read(self) -> bytes:
        return self._body

    async def readline(self) -> bytes:
        assert self._lines is not None
        return await self._lines.get()

    def release(self) -> None:
        pass


class FakeInferenceAPIs:
    """CustomObjectsApi + CoreV1Api answering from fixed objects; records the calls."""

    def __init__(self, pool: dict | None, pods: list[dict]) -> None:
        self.pool, self.pods = pool, pods
        self.calls: list[tuple] = []
        self.watch_lines: asyncio.Queue = asyncio.Queue()

    async def get_namespaced_custom_object(self, group, version, ns, plural, name, **kw):
        self.calls.append(("get", group, version, ns, plural, name))
        if self.pool is None:
            return FakeResp(404, {"kind": "Status", "message": f'inferencepools "{name}" not found'})
        return FakeResp(200, self.pool)

    async def list_namespaced_pod(self, ns, **kw):
        self.calls.append(("watch" if kw.get("watch") else "list", ns, kw["label_selector"]))
        if kw.get("watch"):
            return FakeResp(200, lines=self.watch_lines)
        return FakeResp(200, {"kind": "PodList", "metadata": {"resourceVersion": "9"}, "items": self.pods})


class FakeKubeClient:
    """The ``ApiClient`` the fake APIs above stand on: only ``close``."""

    closed = False

    async def close(self) -> None:
        self.closed = True
