"""The harness itself: a router process starts, answers, reports its resources."""

from __future__ import annotations

import httpx
import pytest

from radixfleet_tools.harness.router_process import RouterProcess

pytestmark = pytest.mark.integration


def test_router_process_reports_resources_and_settles():
    with RouterProcess(argv=["--worker", "http://127.0.0.1:9"]) as r:
        base = r.resources()
        assert base.rss_bytes > 10 << 20 and base.open_fds > 3
        assert httpx.get(f"{r.base}/health", timeout=5).status_code == 200
        r.assert_settles(base)
    r.assert_no_tracebacks()
