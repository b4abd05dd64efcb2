"""The project's exception tree, drawn once.

Expected outcomes are values (no capacity -> ``None``, no match -> empty), not
exceptions. What remains is caller misuse and bad input::

    RadixfleetError                 base of everything raised on purpose
     +-- RequestError               a request is unusable -> HTTP 4xx (a loop: 508)
     |    +-- MalformedRequest      body not an object, missing/ill-typed field -> 400
     |    +-- PayloadTooLarge       body over the configured limit -> 413
     |    +-- PromptTooLarge        prompt can never fit the worker's KV pool -> 400
     |    +-- Unauthorized          missing/wrong bearer token or API key -> 401
     |    +-- Forbidden             an identity or an address this router does not
     |    |                         take (a tokenless agent API off loopback, a
     |    |                         worker host outside registration.allow) -> 403
     |    +-- NotFound              unknown path, model or worker -> 404
     |    +-- Conflict              a name held by someone else (a worker id
     |    |                         registered at another URL) -> 409
     |    +-- Overloaded            concurrency queue full, fleet past its queue
     |    |                         bound -> 429 (Retry-After)
     |    +-- RateLimited           a tenant or API key over its rate limit -> 429
     |    |                         (Retry-After, x-ratelimit-* headers)
     |    +-- OverBurst             a request costing more tokens than its limit's
     |    |                         burst: it can never pass -> 400 (x-ratelimit-*)
     |    +-- NoWorkerAvailable     no healthy, undrained worker -> 503 (Retry-After)
     |    +-- RequestTimeout        head or body not received in time -> 408
     |    +-- LoopDetected          a request came back to the router that sent it
     |                              (a worker URL leading to a router) -> 508
     +-- ConfigError                a YAML/CLI setting is invalid; names the field path
     +-- WorkloadError              a load-test workload or trace is invalid (line number)
     +-- RunError                   a load-test run cannot be made as asked (e.g. an
                                    agent's cache flush failed: it would not start cold)
     +-- MissingExtra               a feature's optional dependencies are not installed;
                                    names the extra to install (radixfleet.wire.extras)

Broken invariants are ``AssertionError`` raised by ``check()`` methods, never
members of this tree.
"""

from __future__ import annotations

from typing import Any


class RadixfleetError(Exception):
    """Base class of every error radixfleet raises on purpose."""


class RequestError(RadixfleetError):
    """A client's request cannot be served as sent.

    ``status`` is the HTTP status the servers answer with, ``code`` the
    OpenAI-style machine-readable code, ``param`` the offending field if any.
    """

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"
    #: seconds a client should wait before retrying (a ``Retry-After`` header), or
    #: None: retrying as sent will not help. Every 429 and 503 carries one.
    retry_after_s: float | None = None
    #: further response headers the answer carries, as (name, value) pairs
    headers: tuple[tuple[str, str], ...] = ()

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-style error body: ``{"error": {message, type, code, param}}``."""
        return error_body(self.message, self.error_type, self.code, self.param)


class MalformedRequest(RequestError):
    status = 400
    code = "malformed_request"


class PayloadTooLarge(RequestError):
    status = 413
    code = "payload_too_large"


class PromptTooLarge(RequestError):
    status = 400
    code = "context_length_exceeded"


class Unauthorized(RequestError):
    status = 401
    error_type = "authentication_error"
    code = "unauthorized"


class Forbidden(RequestError):
    """Who is asking, or what it names, is not taken by this router whatever the
    body; ``code`` says why (an instance may narrow the class's code)."""

    status = 403
    error_type = "permission_error"
    code = "forbidden"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message, param=param)
        if code is not None:
            self.code = code


class NotFound(RequestError):
    status = 404
    error_type = "not_found_error"
    code = "not_found"


class Conflict(RequestError):
    """The request names something another party holds; ``code`` says what (an
    instance may narrow the class's code, e.g. ``worker_id_taken``)."""

    status = 409
    code = "conflict"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message, param=param)
        if code is not None:
            self.code = code


class Overloaded(RequestError):
    status = 429
    error_type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, code: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        if code is not None:
            self.code = code


class RateLimited(RequestError):
    """A tenant or API key over its configured rate (radixfleet.route.tenancy): ``headers``
    are the ``x-ratelimit-*`` headers of the limit that refused it."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, retry_after_s: float, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = headers


class OverBurst(RequestError):
    """A request whose token cost (its prompt and output bound) is above its tenant's
    or API key's ``token_burst`` (radixfleet.route.tenancy): no wait lets it pass, so it is
    refused as sent (no ``Retry-After``); ``headers`` are the limit's ``x-ratelimit-*``."""

    status = 400
    code = "request_too_large"

    def __init__(
        self, message: str, *, param: str | None = None, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message, param=param)
        self.headers = headers


class NoWorkerAvailable(RequestError):
    status = 503
    error_type = "service_unavailable"
    code = "no_worker_available"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class RequestTimeout(RequestError):
    status = 408
    code = "request_timeout"


class LoopDetected(RequestError):
    """A request carried this router's own hop mark back to it (``radixfleet.server.hops``):
    some worker URL leads to a router that leads here. Answered at once, before its
    body is read or an admission slot taken, so a loop costs one hop, not a pile."""

    status = 508
    error_type = "invalid_request_error"
    code = "loop_detected"


def error_body(
    message: str, error_type: str, code: str | int | None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI-style error body every JSON error answer has (the router's own, and
    a worker's error re-wrapped by the data plane)."""
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


def retry_after_header(seconds: float) -> str:
    """The ``Retry-After`` value for ``seconds``: a whole number, at least 1."""
    return str(max(1, int(-(-seconds // 1))))


class ConfigError(RadixfleetError):
    """An invalid setting. ``path`` is the dotted field path (``policy.name``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message
        #: every error found, when one run found several (radixfleet.config.parse_config)
        self.errors: list[ConfigError] = [self]


class WorkloadError(RadixfleetError):
    """An invalid workload parameter or trace line (the message names it)."""


class RunError(RadixfleetError):
    """A load-test run cannot be made as asked (the message says why and how to opt out)."""


class MissingExtra(RadixfleetError, ImportError):
    """A feature needs an optional dependency group (a pip extra) that is not installed.

    One line, naming the extra: ``the 'bus' extra is not installed (the bus: No module
    named 'nats'): pip install 'radixfleet[bus]'``. It is an ``ImportError`` too, so
    code that already falls back when a module is missing keeps doing so."""

    def __init__(self, feature: str, extra: str, missing: str) -> None:
        super().__init__(
            f"the {extra!r} extra is not installed ({feature}: {missing}): pip install 'radixfleet[{extra}]'"
        )
        self.extra = extra
