"""Bearer tokens and the loopback rule, for every radixfleet server (router and agent).

A token comes from an environment variable, never from a file in the image or a
command line (both are readable by other users of the host); "" means the API is
open, which the servers allow only on a loopback address (``radixfleet.server.auth.
check_exposure``, the agent's ``main``). Tokens are compared in constant time
(``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from radixfleet.wire.errors import Unauthorized


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8 (also IPv4-mapped, ``::ffff:127.0.0.1``), ::1 and
    ``localhost``; "" and 0.0.0.0 mean every interface."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class BearerAuth:
    """One API's bearer token ("" = open: only allowed on loopback)."""

    __slots__ = ("token", "env", "what")

    def __init__(self, env: str, what: str) -> None:
        self.env = env
        self.what = what
        self.token = (os.environ.get(env, "") if env else "").encode()

    def accepts(self, header: str | None) -> bool:
        """Whether ``header`` is ``Bearer <token>`` with this token set (False when
        none is: an open API accepts no token, it needs none)."""
        if not self.token or not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[7:].strip().encode("utf-8", "surrogateescape"), self.token)

    def check(self, header: str | None) -> None:
        """Raises ``Unauthorized`` unless ``header`` is ``Bearer <token>``."""
        if not self.token:
            return
        if not header or not header.startswith("Bearer "):
            raise Unauthorized(f"{self.what} API requires 'Authorization: Bearer <token>'")
        # aiohttp and the raw front decode header bytes as UTF-8 with surrogateescape:
        # encoding back the same way gives the bytes sent, valid UTF-8 or not
        if not hmac.compare_digest(header[7:].strip().encode("utf-8", "surrogateescape"), self.token):
            raise Unauthorized(f"invalid {self.what} token")
