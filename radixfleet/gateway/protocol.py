"""The endpoint-picker protocol on Envoy's ``ext_proc`` messages, both ways, sans I/O.

What the Gateway API Inference Extension's endpoint picker says and hears (its
proposal 004; the data plane is any conformant gateway, here a real Envoy)::

    in   ProcessingRequest.request_headers     :method, :path, the client's headers
         ProcessingRequest.request_body        the body, whole (BUFFERED) or in chunks
                                               (FULL_DUPLEX_STREAMED)
         metadata_context  envoy.lb.subset_hint / x-gateway-destination-endpoint-subset
                                               the only endpoints it may pick (a list)
         ProcessingRequest.response_headers    :status; the endpoint that served:
                                               envoy.lb / x-gateway-destination-endpoint-served
                                               (metadata), or the attribute upstream.address
         ProcessingRequest.response_body       the answer: each chunk answered (STREAMED,
                                               replaced where the picker changes it) or
                                               echoed back (FULL_DUPLEX_STREAMED)
    out  header x-gateway-destination-endpoint     "ip:port,ip:port,..." (ordered: the
         dynamic metadata envoy.lb /               pick, then where a retry may go;
           x-gateway-destination-endpoint          both hold the same list)
         ImmediateResponse                     429 (shed, Retry-After), 503 (nothing
                                               ready, nothing in the subset), 4xx for a
                                               bad body: the standalone router's JSON

In FULL_DUPLEX_STREAMED mode every body byte Envoy sends comes back from the picker
(``StreamedBodyResponse``), in chunks of at most ``CHUNK_BYTES``, the last one with
``end_of_stream``; the answer to the request headers waits until the body has ended
(the pick needs the body), and then goes first.

The generated messages come from the ``xds-protos`` package (the ``gateway`` extra),
imported through ``radixfleet.wire.extras.require`` (``pb``).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from radixfleet.wire.extras import require

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS_ID = "x-gateway-inference-fairness-id"
#: the Envoy attribute naming the upstream host an answer came from
UPSTREAM_ADDRESS = "upstream.address"
#: ``ProcessingMode.BodySendMode`` values (``protocol_config``)
BUFFERED, FULL_DUPLEX = 2, 4
#: the largest body chunk sent back in one message (Envoy's own ext_proc chunks are
#: smaller; gRPC's default message bound is 4 MiB)
CHUNK_BYTES = 64 * 1024


@functools.cache
def pb() -> SimpleNamespace:
    """The generated modules: ``ep`` (ext_proc service messages), ``grpc`` (its
    stubs), ``core`` (HeaderValue...), ``status`` (HTTP status codes), ``struct``.
    Raises ``MissingExtra`` naming the ``gateway`` extra."""
    feature = "the gateway's endpoint picker (ext_proc)"
    return SimpleNamespace(
        ep=require("envoy.service.ext_proc.v3.external_processor_pb2", "gateway", feature),
        grpc=require("envoy.service.ext_proc.v3.external_processor_pb2_grpc", "gateway", feature),
        core=require("envoy.config.core.v3.base_pb2", "gateway", feature),
        status=require("envoy.type.v3.http_status_pb2", "gateway", feature),
        struct=require("google.protobuf.struct_pb2", "gateway", feature),
    )


def headers_of(http_headers: Any) -> dict[str, str]:
    """An ``HttpHeaders`` message's headers, lower-case names (HTTP/2's pseudo-headers
    ``:path``, ``:method`` kept). Envoy sends ``raw_value`` bytes (older ones
    ``value``); bytes that are not UTF-8 are kept as surrogate escapes."""
    out: dict[str, str] = {}
    for h in http_headers.headers.headers:
        v = h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value
        k = h.key.lower()
        out[k] = f"{out[k]},{v}" if k in out else v
    return out


def endpoint_of(host: str, port: int) -> str:
    """``ip:port`` as the protocol writes it (IPv6 in brackets); ``host`` an IP literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ip_literal(host: str) -> str | None:
    """``host`` as a normalized IP literal, or None when it is a name."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def _metadata_list(md: Any, namespace: str, key: str) -> list[str] | None:
    """A string list (or one comma-separated string) at ``namespace``/``key`` of a
    ``Metadata`` message's ``filter_metadata``; None when absent."""
    if md is None or namespace not in md.filter_metadata:
        return None
    fields = md.filter_metadata[namespace].fields
    if key not in fields:
        return None
    v = fields[key]
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        items: Iterable[str] = v.string_value.split(",")
    elif kind == "list_value":
        items = (x.string_value for x in v.list_value.values if x.WhichOneof("kind") == "string_value")
    else:
        return []
    return [s.strip() for s in items if s.strip()]


def subset_of(request: Any) -> frozenset[str] | None:
    """The subset hint of a ``ProcessingRequest`` (the endpoints the data plane allows),
    or None when it sets none. An empty hint allows nothing."""
    if not request.HasField("metadata_context"):
        return None
    got = _metadata_list(request.metadata_context, SUBSET_NAMESPACE, SUBSET)
    return None if got is None else frozenset(got)


def served_of(request: Any) -> str | None:
    """The endpoint that served the answer: the data plane's metadata
    (``envoy.lb``/``x-gateway-destination-endpoint-served``), else Envoy's
    ``upstream.address`` attribute; None when neither says (a local reply)."""
    if request.HasField("metadata_context"):
        got = _metadata_list(request.metadata_context, LB_NAMESPACE, SERVED)
        if got:
            return got[0]
    for attrs in request.attributes.values():
        f = attrs.fields.get(UPSTREAM_ADDRESS)
        if f is not None and f.WhichOneof("kind") == "string_value" and f.string_value:
            return f.string_value
    return None


def _set(headers: Iterable[tuple[str, str]], remove: Iterable[str] = ()) -> Any:
    m = pb()
    overwrite = m.core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    return m.ep.HeaderMutation(
        remove_headers=list(remove),
        set_headers=[
            m.core.HeaderValueOption(
                header=m.core.HeaderValue(key=k.lower(), raw_value=v.encode("utf-8", "surrogateescape")),
                append_action=overwrite,
            )
            for k, v in headers
        ],
    )


def pick_metadata(endpoints: list[str]) -> Any:
    """``envoy.lb`` / ``x-gateway-destination-endpoint``: the ordered list, as a
    ``Struct`` of ``dynamic_metadata``."""
    s = pb().struct.Struct()
    s.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = ",".join(endpoints)
    return s


def picked(
    endpoints: list[str],
    *,
    body: bytes | None,
    buffered: bool,
    headers: Iterable[tuple[str, str]] = (),
    header_list: bool = True,
    remove: Iterable[str] = (),
) -> list[Any]:
    """The messages that send a request to ``endpoints`` (ordered: the pick first):
    the header and the metadata, and ``body`` (the bytes the worker is to get; None:
    none came), with ``headers`` set and ``remove`` removed. ``header_list`` False:
    the header names the pick alone (an Envoy ``ORIGINAL_DST`` cluster reads one
    address from it; the metadata keeps the list).

    ``buffered``: the answer to the one ``request_body`` message (BUFFERED mode; the
    body replaced when ``body`` is given) carries the header mutation. Otherwise the
    ``request_headers`` answer carries it (FULL_DUPLEX_STREAMED, where it waited for
    the body, or a request without one), then ``body`` echoed in chunks."""
    m = pb()
    hdrs = [(DESTINATION, ",".join(endpoints) if header_list else endpoints[0]), *headers]
    if body is not None:
        hdrs.append(("content-length", str(len(body))))
    md = pick_metadata(endpoints)
    mutation = _set(hdrs, remove)
    if buffered:
        common = m.ep.CommonResponse(header_mutation=mutation)
        if body is not None:
            common.body_mutation.body = body
        return [m.ep.ProcessingResponse(request_body=m.ep.BodyResponse(response=common), dynamic_metadata=md)]
    out = [
        m.ep.ProcessingResponse(
            request_headers=m.ep.HeadersResponse(response=m.ep.CommonResponse(header_mutation=mutation)),
            dynamic_metadata=md,
        )
    ]
    if body is not None:
        out.extend(streamed(body, True, request=True))
    return out


def streamed(data: bytes, end: bool, *, request: bool) -> Iterator[Any]:
    """``data`` echoed in FULL_DUPLEX_STREAMED mode: ``StreamedBodyResponse`` chunks
    of at most ``CHUNK_BYTES``, ``end_of_stream`` on the last when ``end`` (an empty
    chunk when there is nothing left to carry it)."""
    m = pb()
    n = len(data)
    starts = range(0, n, CHUNK_BYTES) if n else (0,)
    for i in starts:
        last = i + CHUNK_BYTES >= n
        sb = m.ep.StreamedBodyResponse(body=data[i : i + CHUNK_BYTES], end_of_stream=end and last)
        common = m.ep.CommonResponse()
        common.body_mutation.streamed_response.CopyFrom(sb)
        br = m.ep.BodyResponse(response=common)
        yield (
            m.ep.ProcessingResponse(request_body=br) if request else m.ep.ProcessingResponse(response_body=br)
        )


def continue_headers(*, request: bool, headers: Iterable[tuple[str, str]] = ()) -> Any:
    """The plain answer to a request's or response's headers (with ``headers`` set)."""
    m = pb()
    hdrs = list(headers)
    common = m.ep.CommonResponse(header_mutation=_set(hdrs)) if hdrs else m.ep.CommonResponse()
    hr = m.ep.HeadersResponse(response=common)
    return (
        m.ep.ProcessingResponse(request_headers=hr)
        if request
        else m.ep.ProcessingResponse(response_headers=hr)
    )


def skip_response_body(answer: Any, *, buffered: bool) -> None:
    """Makes ``answer`` (the pick) tell Envoy not to send the response's body and
    trailers to the picker (``mode_override``; the filter's ``allow_mode_override``
    must be on, and Envoy takes no override of a FULL_DUPLEX_STREAMED response mode).
    The request's modes stay as configured (``buffered``)."""
    pm = _pm().ProcessingMode
    mode = answer.mode_override
    mode.request_header_mode = pm.SEND
    mode.response_header_mode = pm.SEND
    mode.request_body_mode = pm.NONE
    mode.request_trailer_mode = pm.SKIP
    mode.response_body_mode = pm.NONE
    mode.response_trailer_mode = pm.SKIP


def body_answer(replace: bytes | None) -> Any:
    """The answer to a response body chunk in STREAMED mode: passed on as it came
    (``replace`` None), or replaced by ``replace`` (b"": held back, for a later chunk)."""
    m = pb()
    common = m.ep.CommonResponse()
    if replace is not None:
        common.body_mutation.body = replace
    return m.ep.ProcessingResponse(response_body=m.ep.BodyResponse(response=common))


@functools.cache
def _pm() -> Any:
    return require(
        "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2",
        "gateway",
        "the gateway's endpoint picker (ext_proc)",
    )


def continue_body(*, request: bool) -> Any:
    """The plain answer to a body chunk in BUFFERED or STREAMED mode."""
    m = pb()
    br = m.ep.BodyResponse(response=m.ep.CommonResponse())
    return m.ep.ProcessingResponse(request_body=br) if request else m.ep.ProcessingResponse(response_body=br)


def continue_trailers(*, request: bool) -> Any:
    m = pb()
    tr = m.ep.TrailersResponse()
    return (
        m.ep.ProcessingResponse(request_trailers=tr)
        if request
        else m.ep.ProcessingResponse(response_trailers=tr)
    )


def immediate(
    status: int, body: bytes, headers: Mapping[str, str] | Iterable[tuple[str, str]], details: str
) -> Any:
    """An ``ImmediateResponse``: Envoy answers the client itself, nothing goes
    upstream. ``details`` lands in Envoy's access log (%RESPONSE_CODE_DETAILS%)."""
    m = pb()
    items = headers.items() if isinstance(headers, Mapping) else headers
    return m.ep.ProcessingResponse(
        immediate_response=m.ep.ImmediateResponse(
            status=m.status.HttpStatus(code=status),
            headers=_set(items),
            body=body,
            details=details,
        )
    )
