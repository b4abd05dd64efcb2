"""The quick-start router in front of the two real vLLM servers (the ``quick_start`` fixture)."""

from __future__ import annotations

import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.vllm_router import admin_url, remember_admin


@pytest.fixture(scope="module")
def quick_start(vllm_pair):
    port, admin = free_port(), free_port()  # the admin listener on a free port, not 8001
    remember_admin(port, admin)
    argv = radixfleet_argv(
        "router",
        *("--port", str(port), "--admin-port", str(admin)),
        *(a for s in vllm_pair for a in ("--worker", s.url)),
    )
    with Proc(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=60):
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both probed (vLLM) and scraped
            ws = httpx.get(admin_url(base) + "/admin/workers", timeout=5).json()["workers"]
            if (
                all(w["routable"] and w.get("engine", {}).get("load_source") == "engine" for w in ws)
                and len(ws) == 2
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"workers not ready: {ws}")
        yield base
