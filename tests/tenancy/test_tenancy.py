"""No tenant's prompt is confirmable from outside: cache keys are salted with a
per-deployment secret, the tenant header is taken only from a router that signed it, and
no public endpoint (answers, timings, metrics) tells a probe whether another tenant sent
a prompt. A router in-process in front of in-process agents
(tests/router/test_bad_input.py's ``fleet``)."""

from __future__ import annotations

import httpx
import pytest
from aiohttp.test_utils import TestServer

from radixfleet.common.tenancy import SIGNATURE_HEADER, TenantSalts, signature
from radixfleet.config import parse_config
from radixfleet.keys import Endpoint, request_key
from radixfleet.server.app import Router
from radixfleet_tools.agent.server import AgentConfig, create_app
from tests.router.fleet import PROMPT, fleet  # noqa: F401  (fleet: the fixture)


def _hex_and_dec(hashes):
    out = set()
    for h in hashes:
        out.add(f"{h:016x}")
        out.add(str(h))
    return out


@pytest.mark.integration
async def test_tenant_probe_through_every_public_endpoint_confirms_nothing(fleet, monkeypatch):
    """Tenant acme sends a prompt; an outsider who knows the prompt and the tenant
    name hashes it (with the old public salt, and with any salt he could know) and
    looks for it wherever the router shows something without the admin token."""
    monkeypatch.setenv("RADIXFLEET_ADMIN_TOKEN", "adm")
    up = await fleet.upstream("u")
    up2 = await fleet.upstream("v")
    await fleet.start(
        {
            "workers": [{"url": up, "id": "u"}, {"url": up2, "id": "v"}],
            "keys": {
                "tenant": {
                    "source": "api_key",
                    "api_keys": [{"tenant": "acme", "key": "k-acme"}, {"tenant": "eve", "key": "k-eve"}],
                }
            },
            "policy": {
                "name": "prefix_load",
                "params": {
                    "warm_ahead": True,
                    "hot_min_rate": 0.5,
                    "holder_max_rate": 0.5,
                    "min_match_tokens": 0,
                },
            },
        }
    )
    await fleet.routable(2)
    body = {"model": "m", "prompt": PROMPT}
    guesses = set()
    for salt in ("acme", "", "eve"):
        guesses |= _hex_and_dec(request_key(Endpoint.COMPLETIONS, body, tenant=salt).hashes)
    truth = _hex_and_dec(
        request_key(Endpoint.COMPLETIONS, body, tenant=fleet.router.salts.salt("acme")).hashes
    )
    seen = []
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(30):  # hot: replicas, warm-ups, hot-prefix metrics
            r = await c.post(
                fleet.base + "/v1/completions", json=body, headers={"Authorization": "Bearer k-acme"}
            )
            assert r.status_code == 200
            seen.append(str(r.headers) + r.text)
        for path in (
            "/metrics",
            "/v1/models",
            "/health",
            "/readiness",
            "/openapi.json",
            "/admin/index",
            "/admin/workers",
            "/nope",
        ):
            for base in (fleet.base, fleet.admin):  # the data port and the admin listener
                r = await c.get(base + path, headers={"Authorization": "Bearer k-eve"})
                seen.append(str(r.headers) + r.text)
        r = await c.post(fleet.base + "/v1/completions", json=body, headers={"Authorization": "Bearer k-eve"})
        seen.append(str(r.headers) + r.text)
        hot = (await c.get(fleet.admin + "/admin/index", headers={"Authorization": "Bearer adm"})).json()[
            "hot_prefixes"
        ]
        metrics = (await c.get(fleet.admin + "/metrics")).text
    public = "\n".join(seen)
    assert not [g for g in guesses | truth if g in public]  # 0 confirmations
    # the detail is there, behind the admin token
    assert hot and {h["hash"] for h in hot} & truth
    assert 'radixfleet_hot_prefix_rate{rank="1"}' in metrics


def test_tenant_salt_is_a_secret_per_deployment(monkeypatch):
    monkeypatch.setenv("SALT_A", "deployment-a-secret")
    monkeypatch.setenv("SALT_B", "deployment-b-secret")
    a1 = TenantSalts.from_env("SALT_A", b"")
    a2 = TenantSalts.from_env("SALT_A", b"tok")
    b = TenantSalts.from_env("SALT_B", b"")
    assert a1.salt("acme") == a2.salt("acme") != b.salt("acme")  # replicas agree
    assert a1.salt("acme") not in ("acme", "") and a1.salt("acme") != a1.salt("acme2")
    # without the env var: derived from the agent token, which every replica shares
    t1 = TenantSalts.from_env("UNSET_SALT_ENV", b"tok")
    t2 = TenantSalts.from_env("UNSET_SALT_ENV", b"tok")
    assert t1.salt("x") == t2.salt("x") != TenantSalts.from_env("UNSET_SALT_ENV", b"other").salt("x")
    # two routers of one deployment key a request identically; another deployment does not
    cfg = parse_config({"keys": {"tenant_salt_env": "SALT_A"}})
    assert Router(cfg).tenants.namespace({}) == Router(cfg).tenants.namespace({})
    cfg_b = parse_config({"keys": {"tenant_salt_env": "SALT_B"}})
    assert Router(cfg).tenants.namespace({}) != Router(cfg_b).tenants.namespace({})


@pytest.mark.integration
async def test_agent_takes_the_tenant_header_only_from_a_router(monkeypatch):
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "agt")
    app = create_app(AgentConfig(kv_tokens=50_000, served_model_name="m"))
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    base = str(srv.make_url("")).rstrip("/")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            for headers in (
                {"x-radixfleet-tenant": "acme-salt"},
                {"x-radixfleet-tenant": "acme-salt", SIGNATURE_HEADER: "0" * 32},
            ):
                r = await c.post(base + "/v1/completions", json=body, headers=headers)
                assert r.status_code == 401, r.text
            good = {"x-radixfleet-tenant": "acme-salt", SIGNATURE_HEADER: signature(b"agt", "acme-salt")}
            assert (await c.post(base + "/v1/completions", json=body, headers=good)).status_code == 200
            assert (await c.post(base + "/v1/completions", json=body)).status_code == 200
            # engine_config flushes the cache: the agent token only
            r = await c.post(base + "/internal/v1/engine_config", json={"rope_scaling": None})
            assert r.status_code == 401
            r = await c.post(
                base + "/internal/v1/engine_config",
                json={"rope_scaling": None},
                headers={"Authorization": "Bearer agt"},
            )
            assert r.status_code == 200, r.text
    finally:
        await srv.close()
    # no token: an unsigned header only where nobody but the router can reach the agent
    monkeypatch.delenv("RADIXFLEET_AGENT_TOKEN")
    app = create_app(AgentConfig(kv_tokens=50_000, served_model_name="m", trust_unsigned_tenant=False))
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(
                str(srv.make_url("/v1/completions")), json=body, headers={"x-radixfleet-tenant": "x"}
            )
            assert r.status_code == 401
    finally:
        await srv.close()


@pytest.mark.integration
async def test_router_signs_what_its_agents_check(fleet, monkeypatch):
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "agt")
    await fleet.start({"keys": {"tenant": {"source": "header"}}})
    await fleet.agent("m")
    await fleet.routable(1)
    async with httpx.AsyncClient(timeout=10) as c:
        for tenant in ("acme", "other"):
            r = await c.post(
                fleet.base + "/v1/completions",
                headers={"x-tenant-id": tenant},
                json={"model": "m", "prompt": PROMPT, "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
        r = await c.post(
            fleet.base + "/v1/completions",
            headers={"x-tenant-id": "t" * 300},
            json={"model": "m", "prompt": "x"},
        )
        assert r.status_code == 400 and "tenant header" in r.text
