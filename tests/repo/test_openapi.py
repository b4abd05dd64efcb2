"""The OpenAPI documents stay true: every route the router's and the agent's aiohttp
apps register is described, every described operation is registered, the documents
are valid OpenAPI 3 (schemathesis loads them), and both servers serve them."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from aiohttp import web
from aiohttp.test_utils import TestServer

from radixfleet.config import parse_config
from radixfleet.keys import Endpoint
from radixfleet.server.app import Router
from radixfleet.wire.openapi import agent_spec, operations, router_spec
from radixfleet_tools.agent.server import AgentConfig, create_app

_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def registered(app: web.Application) -> set[tuple[str, str]]:
    """(METHOD, path) of every route of ``app``; "*" routes count as GET and POST
    (the methods they are documented with), aiohttp's automatic HEAD is left out,
    and so is the router's catch-all (its JSON 404/405)."""
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path is None or path == "/{tail}":
            continue
        if route.method == "*":
            out |= {("GET", path), ("POST", path)}
        elif route.method in _METHODS:
            out.add((route.method, path))
    return out


def test_router_spec_matches_its_routes():
    app = Router(parse_config({})).app
    routes = registered(app)
    spec = operations(router_spec())
    assert routes == spec, {"undocumented": routes - spec, "not served": spec - routes}
    for e in Endpoint:
        assert ("POST", e.value) in spec


def test_agent_spec_matches_its_routes():
    routes = registered(create_app(AgentConfig(kv_tokens=10_000)))
    spec = operations(agent_spec())
    assert routes == spec, {"undocumented": routes - spec, "not served": spec - routes}


@pytest.mark.parametrize("spec", [router_spec, agent_spec], ids=["router", "agent"])
def test_specs_are_valid_openapi(spec):
    schema = schemathesis.openapi.from_dict(spec())
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == len(operations(spec()))


@pytest.mark.integration
async def test_both_serve_their_spec():
    router = Router(parse_config({}))
    agent = create_app(AgentConfig(kv_tokens=10_000))
    servers = [TestServer(router.app, host="127.0.0.1"), TestServer(agent, host="127.0.0.1")]
    try:
        for srv, spec in zip(servers, (router_spec(), agent_spec())):
            await srv.start_server()
            async with httpx.AsyncClient() as c:
                r = await c.get(str(srv.make_url("/openapi.json")))
            assert r.status_code == 200 and r.json() == spec
    finally:
        for srv in servers:
            await srv.close()
