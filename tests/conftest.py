"""Shared fixtures. Servers start on 127.0.0.1, on free ports, and are stopped."""

from __future__ import annotations

import pytest

from tests.procs import free_port, Proc  # noqa: F401  (re-exported for tests)


@pytest.fixture
def port() -> int:
    return free_port()
