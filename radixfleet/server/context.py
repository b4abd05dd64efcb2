"""One client request on the data plane, once read: ``RequestContext`` (made by
``DataPlane.context_of``; what each of its attempts and legs reads)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixfleet.keys import Endpoint, PrefixKey
    from radixfleet.route.core import Route
    from radixfleet.route.tenancy import Ticket
    from radixfleet.server.tracing import RequestTrace


@dataclasses.dataclass(slots=True)
class RequestContext:
    """One client request on the data plane: what each of its attempts needs. Made
    by ``serve`` once the body is read and keyed; only ``reason`` and ``route``
    change (a retry's reason is ``fallback``)."""

    ex: Any  # the exchange it came on (module docstring)
    endpoint: Endpoint
    raw: bytes | bytearray  # the client's body, forwarded as it came (one buffer, not copied)
    body: dict  # the same, parsed
    key: PrefixKey  # its routing key (byte space), tenant and model
    stream: bool
    session: str | None  # x-session-id, else the body's "user"; on a bus, its digest
    rid: str  # its request id
    t0: float  # monotonic time it arrived
    reason: str = ""  # why the current attempt's worker was chosen (metrics)
    tenant: str = ""  # its tenant's name (radixfleet.server.auth), for radixfleet.route.tenancy
    api_key: str = ""  # the name of the API key it came with ("" none or unnamed)
    ticket: Ticket | None = None  # its class and rate-limit reservation, once admitted
    route: Route | None = None  # the current attempt's route (its match, its explanation)
    trace: RequestTrace | None = None  # its spans (radixfleet.server.tracing); None: not traced
