"""Shared fixtures. Servers start on 127.0.0.1, on free ports, and are stopped."""

from __future__ import annotations

import pytest

from radixfleet_tools.harness.procs import Proc, free_port  # noqa: F401  (re-exported for tests)

# The tier markers, enforced (tests/tiers.py): hooks take effect by being named here.
from tests.tiers import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_fixture_setup,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)


@pytest.fixture
def port() -> int:
    return free_port()


# --------------------------------------------------------------- real vLLM servers
# Session-scoped: provisioned once (radixfleet_tools/harness/vllm_env.py: the venv, the tiny model)
# and shared by every engine test module. If vLLM cannot be provisioned the tests that
# use these fixtures fail with the reason (EngineUnavailable): they never skip.


@pytest.fixture(scope="session")
def vllm_model_dir():
    from radixfleet_tools.harness.vllm_env import tiny_model, vllm_python

    vllm_python()
    return tiny_model()


@pytest.fixture(scope="session")
def vllm_pair(vllm_model_dir, tmp_path_factory):
    """Two vLLM servers with prefix caching, prompt-token details and KV events (ZMQ,
    replay), 16k-token KV caches, at most 8 running sequences each."""
    from radixfleet_tools.harness.vllm_env import VllmServer, own_core

    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [
        VllmServer(
            free_port(),
            model=vllm_model_dir,
            events_port=free_port(),
            replay_port=free_port(),
            log_path=logs / f"vllm-{i}.log",
            omp_cpus=own_core(i),
        )
        for i in range(2)
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


# --------------------------------------------------------------- the bus
@pytest.fixture
def bus_salt(monkeypatch):
    """Replicas on a bus share the deployment's salt secret (radixfleet.config.reload refuses a
    bus without one); routers started as processes inherit it."""
    monkeypatch.setenv("RADIXFLEET_TENANT_SALT", "test-bus-deployment-secret")
