"""The router's own server: where it listens (``listen:``, the data port, and ``admin:``,
the admin listener; both read at start) and hot reload of its file (``reload:``).
"""

from __future__ import annotations

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class ListenConfig:
    """``listen:``: the router's address (read at start; a reload keeps it)."""

    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "TCP port", lo=0, hi=65535)


@settings
class AdminListenConfig:
    """``admin:``: the admin listener (``/admin/*``, ``/metrics``, ``/openapi.json``, probes),
    apart from the data port (``listen``) as Envoy's admin is. Read at start."""

    host: str = _opt(
        "127.0.0.1",
        "address of the admin listener; off loopback it needs the admin token "
        "(and a scraper the metrics token)",
    )
    port: int = _opt(8001, "TCP port of the admin listener; 0: a free port (logged)", lo=0, hi=65535)


@settings
class ReloadConfig:
    """``reload:``: the file watcher (``radixfleet.config.reload.ConfigWatch``)."""

    watch: bool = _opt(
        True,
        "reload when the file changes (inode, mtime or size), once it is unchanged at two "
        "consecutive polls (a file being written waits until it is whole)",
    )
    poll_interval_s: float = _opt(1.0, "interval of the watcher's polls", lo=0, lo_open=True)
