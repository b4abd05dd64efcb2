"""What is checked of a whole config against this host, at start, at reload and by
check-config, after it parsed: the ``models:`` tokenizers load
(``load_model_keyers``), and the events endpoints the router would bind are
addresses of this host that no engine holds (``check_event_binds``).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from radixfleet.config.document import Config
from radixfleet.config.engines import concrete_host
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import raise_all


def check_event_binds(cfg: Config) -> None:
    """The run-time half of ``check_event_sides`` for the endpoints the router will
    bind (a concrete ``tcp://HOST:PORT``, mode auto or bind): HOST must be an
    address of this host and PORT free; an engine that already holds it binds it
    itself (it was given a wildcard), and the router must connect instead. Called
    at start and by check-config, before the router binds anything. Raises
    ``ConfigError`` listing every such endpoint."""
    import socket

    found = []
    for i, w in enumerate(cfg.workers):
        ev = w.events
        if not ev.endpoint or not concrete_host(ev.endpoint) or ev.mode == "connect":
            continue
        host, _, port = ev.endpoint[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        path = f"workers[{i}].events.endpoint"
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            found.append(
                ConfigError(path, f"{ev.endpoint}: host {host!r} does not resolve ({exc.strerror or exc})")
            )
            continue
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    found.append(
                        ConfigError(
                            path,
                            f"{ev.endpoint} is a concrete host, so the "
                            "router would bind it (vLLM connects to a "
                            "concrete endpoint), but another process already "
                            "holds the port: the engine binds it (it was "
                            f"given tcp://*:{port}). Write tcp://*:{port} "
                            "here: the router then connects to the "
                            "worker's host",
                        )
                    )
                elif exc.errno == errno.EADDRNOTAVAIL:
                    found.append(
                        ConfigError(
                            path,
                            f"{ev.endpoint} is a concrete host, so the "
                            f"router would bind it, but {host} is not an "
                            "address of this host. If the engine was given "
                            f"tcp://*:{port} (it binds), write that here; if "
                            "it connects, give it this router's address",
                        )
                    )
                else:
                    found.append(
                        ConfigError(path, f"{ev.endpoint}: the router cannot bind it ({exc.strerror or exc})")
                    )
    raise_all(found)


def load_model_keyers(
    cfg: Config, loaded: Mapping[tuple[str, str], Any] | None = None
) -> dict[tuple[str, str], Any]:
    """Loads the tokenizer of every ``models:`` entry (a second or two each; ``loaded``
    ones are reused): {(tokenizer, chat_template): TokenKeyer}. Raises
    ``ConfigError`` naming ``models.<name>.tokenizer`` for each that cannot load —
    at start, at reload (the running config stays) and in check-config."""
    out: dict[tuple[str, str], Any] = {}
    found: list[ConfigError] = []
    for name, m in cfg.models.items():
        if not m.tokenizer:
            continue
        key = (m.tokenizer, m.chat_template)
        if key in out:
            continue
        if loaded and key in loaded:
            out[key] = loaded[key]
            continue
        # imported only for a tokenizer to load: it needs the engines extra
        from radixfleet.engines.token_keys import TokenKeyer

        options: dict[str, Any] = {"chat_template": m.chat_template} if m.chat_template else {}
        try:
            out[key] = TokenKeyer.load(m.tokenizer, **options)
        except Exception as exc:  # noqa: BLE001 - TokenizerLoadError, or a broken folder
            cause = getattr(exc, "cause", None) or " ".join(str(exc).split())[:300]
            found.append(
                ConfigError(f"models.{name}.tokenizer", f"{m.tokenizer!r} cannot be loaded: {cause}")
            )
    raise_all(found)
    return out
