"""Discovery of a Gateway API Inference Extension ``InferencePool``'s pods
(``inference.networking.k8s.io/v1``), for the endpoint picker it names.

    GET  .../apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools/NAME
         -> spec.selector.matchLabels (a Pod label selector, same namespace)
            spec.targetPorts[].number  (each pod is one endpoint per port)
    list + watch /api/v1/namespaces/NS/pods?labelSelector=k=v,...
         -> the same reflector loop as the EndpointSlice watch (k8s.SliceWatch:
            pages, bookmarks, 410 relist, garbage contained), one object per pod

Rules:
- A pod counts when its ``status.podIP`` is set, its ``Ready`` condition is
  ``"True"`` and it has no ``deletionTimestamp`` (a terminating pod takes no new
  request). Its endpoints are ``http://podIP:port`` for every target port; the
  worker id is the pod's name, ``name:port`` when the pool has several ports (GIE:
  every port is a distinct endpoint).
- The pool is read when the source starts (and each time the manager restarts it):
  a changed selector or port list applies at the next restart, not live.
- A pool that does not exist, or one whose spec is not a v1 InferencePool, is a
  ``SourceError`` (the manager backs off and retries; the pool keeps what it knew).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from radixfleet.config import K8sDiscoveryConfig, K8sSelectorSpec, WorkerSpec
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint, SourceError, url_for
from radixfleet.fleet.discovery.k8s import KubernetesSource, SliceWatch, _read_json, follow, own_namespace
from radixfleet.wire.extras import require

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def parse_pool(obj: Any) -> tuple[str, tuple[int, ...]]:
    """A v1 InferencePool object -> (its Pod label selector as ``k=v,...``, its
    target ports). Raises ``ValueError`` naming what is missing or wrong."""
    spec = obj.get("spec") if isinstance(obj, dict) else None
    if not isinstance(spec, dict):
        raise ValueError("no spec")
    sel = spec.get("selector")
    labels = sel.get("matchLabels") if isinstance(sel, dict) else None
    if not isinstance(labels, dict) or not labels:
        raise ValueError("spec.selector.matchLabels missing or empty")
    if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()):
        raise ValueError("spec.selector.matchLabels: expected string keys and values")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        raise ValueError("spec.targetPorts: expected 1 to 8 ports")
    numbers = []
    for p in ports:
        n = p.get("number") if isinstance(p, dict) else None
        if type(n) is not int or not 0 < n < 65536:
            raise ValueError(f"spec.targetPorts: {p!r} is not a port")
        numbers.append(n)
    if len(set(numbers)) != len(numbers):
        raise ValueError("spec.targetPorts: port numbers must be unique")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), tuple(numbers)


def parse_pod(
    obj: Any, ports: tuple[int, ...], kind: str, template: WorkerSpec = WorkerSpec()
) -> tuple[str, str, list[Endpoint]]:
    """One Pod object -> (name, resourceVersion, its endpoints: none unless it is
    ready, addressed and not terminating). Raises ``ValueError`` if malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise ValueError("metadata.name missing")
    name, rv = meta["name"], meta.get("resourceVersion", "")
    if not isinstance(rv, str):
        raise ValueError(f"pod {name}: metadata.resourceVersion is not a string")
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        raise ValueError(f"pod {name}: status is not an object")
    conds = status.get("conditions") or []
    if not isinstance(conds, list):
        raise ValueError(f"pod {name}: status.conditions is not a list")
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or not ready or not ip:
        return name, rv, []
    if not isinstance(ip, str):
        raise ValueError(f"pod {name}: status.podIP is not a string")
    addr = str(ipaddress.ip_address(ip))  # ValueError if not an address
    one = len(ports) == 1
    return (
        name,
        rv,
        [Endpoint(name if one else f"{name}:{p}", url_for(addr, p), kind, template) for p in ports],
    )


class PodWatch(SliceWatch):
    """``SliceWatch``'s list + watch over the Pods of one label selector (one
    ``slices`` entry per pod: its endpoints)."""

    what = "Pods"

    def __init__(self, api, sel: K8sSelectorSpec, ports: tuple[int, ...], *args: Any, **kw: Any) -> None:
        super().__init__(api, sel, *args, **kw)
        self.ports = ports

    def _apply_object(self, slices: dict[str, list[Endpoint]], obj: Any) -> str | None:
        try:
            name, rv, eps = parse_pod(obj, self.ports, self.sel.kind, self.template)
        except ValueError as exc:
            self.problems.report("invalid_object", "Pod skipped: %s", exc)
            return None
        slices[name] = eps
        return rv

    async def _open(self, kw: dict, timeout: tuple[float, float]):
        try:
            return await self.api.list_namespaced_pod(
                self.namespace, _preload_content=False, _request_timeout=timeout, **kw
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise SourceError("unreachable", f"API server unreachable: {exc!r}") from None


class InferencePoolSource(KubernetesSource):
    """The ready pods of the InferencePool ``pool`` (namespace ``namespace``, else
    ``cfg.namespace``, else the pod's own), each carrying ``template``'s engine kind
    and settings (a selector entry's: ``K8sSelectorSpec``; its ``label_selector``
    is the pool's). The API server, token and watch settings are ``cfg``'s."""

    name = "inference_pool"

    def __init__(
        self,
        cfg: K8sDiscoveryConfig,
        metrics: DiscoveryMetrics,
        pool: str,
        *,
        namespace: str = "",
        template: K8sSelectorSpec | None = None,
        backoff_s: float = 1.0,
    ) -> None:
        super().__init__(cfg, metrics, backoff_s=backoff_s)
        self.pool = pool
        self.namespace = namespace
        self.template = template or K8sSelectorSpec(label_selector="(the InferencePool's)", kind="openai")

    async def read_pool(self, custom, namespace: str) -> tuple[str, tuple[int, ...]]:
        """The pool's (label selector, target ports), from ``custom`` (a
        kubernetes_asyncio ``CustomObjectsApi``)."""
        where = f"InferencePool {namespace}/{self.pool}"
        try:
            resp = await custom.get_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                self.pool,
                _preload_content=False,
                _request_timeout=(10.0, 30.0),
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise SourceError("unreachable", f"API server unreachable: {exc!r}") from None
        except Exception as exc:  # kubernetes_asyncio's ApiException: a status it refused
            status = getattr(exc, "status", None)
            raise SourceError(
                "http_status", f"get {where} answered {status}: {getattr(exc, 'reason', exc)}"
            ) from None
        try:
            body = await _read_json(resp)
            if resp.status != 200:
                msg = body.get("message") if isinstance(body, dict) else None
                raise SourceError(
                    "http_status", f"get {where} answered {resp.status}: {msg or '(no message)'}"
                )
        finally:
            resp.release()
        try:
            return parse_pool(body)
        except ValueError as exc:
            raise SourceError("garbage", f"{where}: {exc}") from None

    async def snapshots(self) -> AsyncGenerator[frozenset[Endpoint], None]:
        client, _ = self._client()
        try:
            custom, core = self._apis(client)
            ns = self.namespace or self.cfg.namespace or own_namespace()
            selector, ports = await self.read_pool(custom, ns)
            sel = dataclasses.replace(self.template, label_selector=selector, namespace=ns)
            watch = PodWatch(core, sel, ports, ns, self.cfg, self.metrics, self.problems, self.backoff_s)
            async with contextlib.aclosing(follow([watch])) as answers:
                async for snap in answers:
                    yield snap
        finally:
            await client.close()

    def _apis(self, client) -> tuple[Any, Any]:
        """(CustomObjectsApi, CoreV1Api) on ``client``."""
        kc = require("kubernetes_asyncio.client", "k8s", "the InferencePool discovery")
        return kc.CustomObjectsApi(client), kc.CoreV1Api(client)
