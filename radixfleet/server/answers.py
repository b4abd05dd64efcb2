"""What the data plane answers a client for a worker's answer or failure: the
headers naming an answer, the OpenAI error shapes (``radixfleet.wire.errors.error_body``)
of a worker's error and of each failure cause, naming no worker, and the usage a
non-streamed answer reports."""

from __future__ import annotations

import json

from radixfleet.server.sse import completion_tokens_of, usage_of
from radixfleet.wire.errors import error_body

TENANT_HEADER = "x-radixfleet-tenant"
WORKER_HEADER = "x-radixfleet-worker"
AVAILABLE_HEADER = "x-radixfleet-available-tokens"
PREDICTED_HEADER = "x-radixfleet-predicted-tokens"
REQUEST_ID_HEADER = "x-request-id"

JSON = "application/json"
DONE = b"data: [DONE]\n\n"


def retry_after(status: int, headers) -> list[tuple[str, str]]:
    """A worker's ``Retry-After`` for a 429 or 503 it answered (1 s if it gave
    none): no client sees either without one."""
    if status != 429 and status != 503:
        return []
    v = headers.get("retry-after", "")
    return [("Retry-After", v if v.isdigit() and len(v) <= 6 else "1")]


#: the client's error per failure cause: (status, code, message); no worker named
CLIENT_ERRORS = {
    "connect": (502, "bad_gateway", "no worker could be reached"),
    "unhealthy": (502, "bad_gateway", "the worker became unavailable"),
    "timeout": (504, "upstream_timeout", "the worker did not answer in time"),
    "payload": (502, "bad_gateway", "the worker's answer was cut off or malformed"),
    "no_answer": (502, "bad_gateway", "the worker closed the connection without answering"),
    "rank": (502, "bad_gateway", "the worker refused the data-parallel rank it was sent"),
    "too_large": (
        502,
        "upstream_response_too_large",
        "the worker's answer is larger than this router passes on (limits.max_response_bytes)",
    ),
}
_MAX_WORKER_MESSAGE = 2000  # characters of a worker's 4xx message passed on


def client_error(cause: str) -> tuple[int, bytes]:
    status, code, message = CLIENT_ERRORS.get(cause, CLIENT_ERRORS["payload"])
    return status, json.dumps(error_body(message, "upstream_error", code)).encode()


def status_error(status: int, data: bytes) -> bytes:
    """The client's body for a worker's error answer ``status`` (>= 400): a 4xx keeps
    the worker's message, type, code and param when its body says them (OpenAI's
    ``{"error": {...}}``, vLLM's and SGLang's ``{"object": "error", ...}``, FastAPI's
    ``{"detail": "..."}``), re-encoded in the OpenAI shape; anything else gets the
    router's own message."""
    if status == 429:
        return json.dumps(
            error_body("the worker is at capacity; retry later", "rate_limit_error", "upstream_overloaded")
        ).encode()
    if status == 503:
        return json.dumps(
            error_body(
                "the worker is unavailable; retry later", "service_unavailable", "upstream_unavailable"
            )
        ).encode()
    if status >= 500:
        return json.dumps(
            error_body(f"the worker failed to answer (HTTP {status})", "upstream_error", "upstream_error")
        ).encode()
    etype = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    message, code, param = f"the worker refused the request (HTTP {status})", None, None
    try:
        obj = json.loads(data) if len(data) <= 1 << 20 else None
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        src = err if isinstance(err, dict) else obj
        m = src.get("message", src.get("detail"))
        if isinstance(m, str) and m:
            message = m[:_MAX_WORKER_MESSAGE]
            t, c, p = src.get("type"), src.get("code"), src.get("param")
            if isinstance(t, str) and t and len(t) <= 64:
                etype = t
            if (isinstance(c, str) and len(c) <= 64) or (type(c) is int):
                code = c
            if isinstance(p, str) and len(p) <= 256:
                param = p
    return json.dumps(error_body(message, etype, code, param)).encode()


def usage_of_body(data: bytes) -> tuple[tuple[int, int] | None, int | None]:
    """((prompt_tokens, cached_tokens) or None, completion_tokens or None) of a
    non-streamed answer, as far as it reports them."""
    if b'"usage"' not in data and b'"meta_info"' not in data:
        return None, None
    try:
        obj = json.loads(data)
    except ValueError:
        return None, None
    return usage_of(obj), completion_tokens_of(obj)
