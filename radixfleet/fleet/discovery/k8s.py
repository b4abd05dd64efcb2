"""Kubernetes discovery: list + watch of EndpointSlices (``discovery.k8s.io/v1``)
through the API server, with ``kubernetes_asyncio`` for the transport (in-cluster
config, service-account token refresh, TLS, request building).

Per selector, the reflector loop client-go runs::

    list (limit/continue pages)  -> slices{name: endpoints}, resourceVersion rv
    watch?resourceVersion=rv&allowWatchBookmarks=true&timeoutSeconds=T
        ADDED | MODIFIED  -> slices[name] = its ready endpoints      (rv = object's)
        DELETED           -> slices.pop(name)                       (rv = object's)
        BOOKMARK          -> rv = object's (nothing else changes)
        ERROR 410 Gone    -> relist                 (watch_restarts{reason=expired})
        ERROR other       -> SourceError: the manager backs off and restarts
        stream ends       -> watch again from rv    (reason=closed: timeout, or the
                             connection dropped: reason=dropped)

Only endpoints whose ``conditions.ready`` is not false count (``ready`` unset means
ready, as the API documents; a terminating pod is never ready). An endpoint's id is
its pod's name (``targetRef``), else its address; its URL is the first address and
the slice port named ``port_name`` (or the slice's only port).

Garbage is counted and contained: a response that is not a list, or a watch line
that is not an event, raises ``SourceError("garbage")`` (relist after backoff; the
pool keeps what it knew); one malformed slice or endpoint inside a valid answer is
skipped (``invalid_object``) and the rest applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import re
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from radixfleet.config import (
    SERVICE_ACCOUNT_DIR,
    K8sDiscoveryConfig,
    K8sSelectorSpec,
    WorkerSpec,
    selector_template,
)
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint, Problems, SourceError, url_for
from radixfleet.wire.extras import require

log = logging.getLogger("radixfleet.discovery")

_MAX_PAGES = 10_000  # a list that never ends is garbage, not a fleet
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def own_namespace(path: str = f"{SERVICE_ACCOUNT_DIR}/namespace") -> str:
    """The namespace this pod runs in (from its service account)."""
    try:
        with open(path, encoding="utf-8") as f:
            ns = f.read().strip()
    except OSError as exc:
        raise SourceError(
            "config",
            f"no namespace configured and {path} unreadable "
            f"({exc.strerror or exc}): set workers.discovery.kubernetes."
            "namespace",
        ) from None
    if not ns:
        raise SourceError("config", f"{path} is empty")
    return ns


def parse_slice(
    obj: Any, port_name: str, kind: str, template: WorkerSpec = WorkerSpec()
) -> tuple[str, str, list[Endpoint], int]:
    """One EndpointSlice object -> (name, resourceVersion, ready endpoints, number
    of malformed endpoints skipped). ``template``: the worker entry each endpoint
    carries (its selector's settings). Raises ``ValueError`` if the slice itself is
    malformed (no name, bad ports)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise ValueError("metadata.name missing")
    name = meta["name"]
    rv = meta.get("resourceVersion", "")
    if not isinstance(rv, str):
        raise ValueError(f"slice {name}: metadata.resourceVersion is not a string")
    port = _pick_port(obj.get("ports"), port_name, name)
    atype = obj.get("addressType")
    eps = obj.get("endpoints")
    if eps is None:
        return name, rv, [], 0  # a slice with no endpoints serializes them as null
    if not isinstance(eps, list):
        raise ValueError(f"slice {name}: endpoints is not a list")
    if port is None:
        return name, rv, [], 0
    out: list[Endpoint] = []
    bad = 0
    for e in eps:
        try:
            ep = _endpoint(e, atype, port, kind, template)
        except ValueError:
            bad += 1
            continue
        if ep is not None:
            out.append(ep)
    return name, rv, out, bad


def _pick_port(ports: Any, port_name: str, slice_name: str) -> int | None:
    if ports is None:
        return None
    if not isinstance(ports, list):
        raise ValueError(f"slice {slice_name}: ports is not a list")
    cands = (
        [p for p in ports if isinstance(p, dict) and (p.get("name") or "") == port_name]
        if port_name
        else [p for p in ports if isinstance(p, dict)]
    )
    if len(cands) != 1:
        return None  # no such port here (another Service's slice, or ambiguous)
    port = cands[0].get("port")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"slice {slice_name}: port {port!r} is not a port number")
    return port


def _endpoint(e: Any, atype: Any, port: int, kind: str, template: WorkerSpec) -> Endpoint | None:
    if not isinstance(e, dict):
        raise ValueError("endpoint is not an object")
    cond = e.get("conditions") or {}
    if not isinstance(cond, dict):
        raise ValueError("conditions is not an object")
    if cond.get("ready") is False:
        return None
    addrs = e.get("addresses")
    if not isinstance(addrs, list) or not addrs or not isinstance(addrs[0], str):
        raise ValueError("addresses missing")
    addr = addrs[0]
    if atype in ("IPv4", "IPv6"):
        ip = ipaddress.ip_address(addr)  # ValueError if not an address
        if (ip.version == 4) != (atype == "IPv4"):
            raise ValueError(f"{addr} is not {atype}")
        addr = str(ip)
    elif atype == "FQDN":
        if not _HOSTNAME.match(addr):
            raise ValueError(f"{addr!r} is not a hostname")
    else:
        raise ValueError(f"addressType {atype!r}")
    ref = e.get("targetRef")
    wid = addr if ":" not in addr else f"[{addr}]"
    if (
        isinstance(ref, dict)
        and ref.get("kind") == "Pod"
        and isinstance(ref.get("name"), str)
        and ref["name"]
    ):
        wid = ref["name"]
    else:
        wid = f"{wid}:{port}"
    return Endpoint(wid, url_for(addr, port), kind, template)


class _Relist(Exception):
    """The watch cannot resume (410 Gone): list again."""


class SliceWatch:
    """The list + watch of one selector. ``slices`` is its current view (slice name
    -> ready endpoints); ``listed`` turns true after the first complete list.
    ``what`` names the objects in messages (a subclass lists other objects:
    ``inference_pool.PodWatch``)."""

    what = "EndpointSlices"

    def __init__(
        self,
        api,
        sel: K8sSelectorSpec,
        namespace: str,
        cfg: K8sDiscoveryConfig,
        metrics: DiscoveryMetrics,
        problems: Problems,
        backoff_s: float,
    ) -> None:
        self.api = api  # kubernetes_asyncio DiscoveryV1Api
        self.sel = sel
        self.namespace = namespace
        self.cfg = cfg
        self.metrics = metrics
        self.problems = problems
        self.backoff_s = backoff_s
        self.template = selector_template(sel)  # what each endpoint found carries
        self.slices: dict[str, list[Endpoint]] = {}
        self.rv = ""  # resourceVersion the next watch resumes from
        self.listed = False
        self._rand = random.Random()

    async def run(self, changed: asyncio.Queue) -> None:
        """Lists, then watches forever, putting ``None`` on ``changed`` after every
        change of ``slices``. Raises ``SourceError`` when it cannot go on."""
        loop = asyncio.get_running_loop()
        listed_at = float("-inf")
        while True:
            if loop.time() - listed_at < 1.0:
                # relisting again at once (a 410 right after a list) must not spin us
                await asyncio.sleep(self.backoff_s)
            listed_at = loop.time()
            await self._list()
            changed.put_nowait(None)
            while True:
                t0 = loop.time()
                try:
                    events, reason = await self._watch(changed)
                except _Relist:
                    self.metrics.watch_restarts.labels("kubernetes", "expired").inc()
                    log.info(
                        "kubernetes discovery: resourceVersion %s expired (410), relisting %s",
                        self.rv,
                        self.sel.label_selector,
                    )
                    break
                self.metrics.watch_restarts.labels("kubernetes", reason).inc()
                if not events and loop.time() - t0 < 1.0:
                    # a server that closes every watch at once must not spin us
                    await asyncio.sleep(self.backoff_s)

    # ---------------------------------------------------------------- list

    async def _list(self) -> None:
        for attempt in range(2):
            slices: dict[str, list[Endpoint]] = {}
            token = None
            for _ in range(_MAX_PAGES):
                kw: dict[str, Any] = {"label_selector": self.sel.label_selector, "limit": self.cfg.page_size}
                if token:
                    kw["_continue"] = token
                status, body = await self._get(kw, timeout=(10.0, 60.0))
                if status == 410 and token and attempt == 0:
                    break  # the continue token expired: list again from the start
                if status != 200:
                    raise SourceError(
                        "http_status",
                        f"list of {self.what} "
                        f"({self.sel.label_selector}) answered {status}: "
                        f"{_status_message(body)}",
                    )
                if not isinstance(body, dict) or not isinstance(body.get("items"), (list, type(None))):
                    raise SourceError("garbage", f"list answer is not a list of {self.what}")
                meta = body.get("metadata")
                if not isinstance(meta, dict) or not isinstance(meta.get("resourceVersion"), str):
                    raise SourceError("garbage", "list answer has no metadata.resourceVersion")
                for obj in body.get("items") or ():
                    self._apply_object(slices, obj)
                rv = meta["resourceVersion"]
                token = meta.get("continue") or None
                if not token:
                    self.slices, self.rv, self.listed = slices, rv, True
                    return
            else:
                raise SourceError("garbage", f"list did not end after {_MAX_PAGES} pages")
        raise SourceError("http_status", "list continue token expired twice")

    def _apply_object(self, slices: dict[str, list[Endpoint]], obj: Any) -> str | None:
        try:
            name, rv, eps, bad = parse_slice(obj, self.sel.port_name, self.sel.kind, self.template)
        except ValueError as exc:
            self.problems.report("invalid_object", "EndpointSlice skipped: %s", exc)
            return None
        if bad:
            self.problems.report("invalid_object", "slice %s: %d malformed endpoint(s) skipped", name, bad)
        slices[name] = eps
        return rv

    # --------------------------------------------------------------- watch

    async def _watch(self, changed: asyncio.Queue) -> tuple[int, str]:
        """One watch from ``self.rv``. Returns (events applied, why it ended:
        ``closed`` | ``dropped``); raises ``_Relist`` on 410, ``SourceError`` on
        anything else that is wrong."""
        t = self.cfg.watch_timeout_s
        timeout_s = int(t + self._rand.random() * t)  # spread reconnects, as client-go
        kw = {
            "label_selector": self.sel.label_selector,
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": self.rv,
            "timeout_seconds": timeout_s,
        }
        resp = await self._open(kw, timeout=(10.0, timeout_s + 30.0))
        events = 0
        try:
            if resp.status == 410:
                raise _Relist()
            if resp.status != 200:
                body = await _read_json(resp)
                raise SourceError("http_status", f"watch answered {resp.status}: {_status_message(body)}")
            while True:
                try:
                    line = await resp.content.readline()
                except (
                    aiohttp.ClientPayloadError,
                    aiohttp.ClientConnectionError,
                    ConnectionError,
                    asyncio.TimeoutError,
                ):
                    return events, "dropped"
                except ValueError as exc:  # a line over the read buffer
                    raise SourceError("garbage", f"watch line unreadable: {exc}") from None
                if not line:
                    return events, "closed"
                if not line.strip():
                    continue
                if self._event(line):
                    events += 1
                    changed.put_nowait(None)
        finally:
            resp.release()

    def _event(self, line: bytes) -> bool:
        """Applies one watch event line; True if ``slices`` changed."""
        try:
            ev = json.loads(line)
        except ValueError:
            raise SourceError("garbage", f"watch line is not JSON: {line[:80]!r}") from None
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            raise SourceError("garbage", f"watch line is not an event: {line[:80]!r}")
        etype, obj = ev["type"], ev.get("object")
        if etype == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                raise _Relist()
            raise SourceError("watch_error", f"watch error {code}: {_status_message(obj)}")
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if etype == "BOOKMARK":
            if not isinstance(rv, str) or not rv:
                raise SourceError("garbage", "BOOKMARK without metadata.resourceVersion")
            self.rv = rv
            return False
        if etype in ("ADDED", "MODIFIED"):
            new_rv = self._apply_object(self.slices, obj)
            if new_rv is None:
                return False
            self.rv = new_rv or self.rv
            return True
        if etype == "DELETED":
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str):
                self.problems.report("invalid_object", "DELETED event without a name")
                return False
            self.slices.pop(name, None)
            if isinstance(rv, str) and rv:
                self.rv = rv
            return True
        self.problems.report("invalid_object", "unknown watch event type %r", etype)
        return False

    # ----------------------------------------------------------- transport

    async def _open(self, kw: dict, timeout: tuple[float, float]):
        try:
            return await self.api.list_namespaced_endpoint_slice(
                self.namespace, _preload_content=False, _request_timeout=timeout, **kw
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise SourceError("unreachable", f"API server unreachable: {exc!r}") from None

    async def _get(self, kw: dict, timeout: tuple[float, float]) -> tuple[int, Any]:
        resp = await self._open(kw, timeout)
        try:
            return resp.status, await _read_json(resp)
        finally:
            resp.release()


async def _read_json(resp) -> Any:
    try:
        raw = await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise SourceError("unreachable", f"API server answer cut: {exc!r}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise SourceError("garbage", f"answer ({resp.status}) is not JSON: {raw[:80]!r}") from None


def _status_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"][:200]
    return "(no Status message)"


class KubernetesSource:
    """EndpointSlices matching ``cfg.selectors``, as one desired set."""

    name = "kubernetes"

    def __init__(self, cfg: K8sDiscoveryConfig, metrics: DiscoveryMetrics, *, backoff_s: float = 1.0) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.backoff_s = backoff_s
        self.problems = Problems(self.name, metrics)

    def _client(self):
        kc = require("kubernetes_asyncio.client", "k8s", "workers.discovery.kubernetes")
        k8s_config = require("kubernetes_asyncio.config", "k8s", "workers.discovery.kubernetes")
        ConfigException, load_incluster_config = (
            k8s_config.ConfigException,
            k8s_config.load_incluster_config,
        )

        conf = kc.Configuration()
        if self.cfg.api_server:
            conf.host = self.cfg.api_server.rstrip("/")
            try:
                with open(self.cfg.token_file, encoding="utf-8") as f:
                    conf.api_key["BearerToken"] = "Bearer " + f.read().strip()
            except FileNotFoundError:
                pass  # e.g. ``kubectl proxy``: no token needed
            except OSError as exc:
                raise SourceError(
                    "config", f"cannot read {self.cfg.token_file}: {exc.strerror or exc}"
                ) from None
            ca = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
            if conf.host.startswith("https://"):
                try:
                    open(ca, "rb").close()
                    conf.ssl_ca_cert = ca
                except OSError:
                    pass  # the system's CAs
        else:
            try:
                load_incluster_config(client_configuration=conf)
            except ConfigException as exc:
                raise SourceError(
                    "config", f"not in a cluster ({exc}): set workers.discovery.kubernetes.api_server"
                ) from None
        return kc.ApiClient(configuration=conf), kc.DiscoveryV1Api

    async def snapshots(self) -> AsyncGenerator[frozenset[Endpoint], None]:
        client, api_cls = self._client()
        try:
            api = api_cls(client)
            default_ns = self.cfg.namespace or own_namespace()
            watches = [
                SliceWatch(
                    api,
                    sel,
                    sel.namespace or default_ns,
                    self.cfg,
                    self.metrics,
                    self.problems,
                    self.backoff_s,
                )
                for sel in self.cfg.selectors
            ]
            async with contextlib.aclosing(follow(watches)) as answers:
                async for snap in answers:
                    yield snap
        finally:
            await client.close()


async def follow(watches: list[SliceWatch]) -> AsyncGenerator[frozenset[Endpoint], None]:
    """Runs ``watches`` and yields the union of their endpoints whenever it changes,
    once every one has listed; raises what any of them raised."""
    changed: asyncio.Queue = asyncio.Queue()

    async def guard(w: SliceWatch) -> None:
        try:
            await w.run(changed)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            changed.put_nowait(exc)

    tasks = [asyncio.create_task(guard(w)) for w in watches]
    try:
        last: frozenset[Endpoint] | None = None
        while True:
            item = await changed.get()
            while True:  # coalesce what is already queued: no added latency
                if isinstance(item, BaseException):
                    raise item
                if changed.empty():
                    break
                item = changed.get_nowait()
            if not all(w.listed for w in watches):
                continue
            snap = frozenset(ep for w in watches for eps in w.slices.values() for ep in eps)
            if snap != last:
                last = snap
                yield snap
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
