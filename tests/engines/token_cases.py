"""The recorded engine token ids (tests/data/vllm_token_ids.json) and the check that the
router's keyer gives the same ones."""

from __future__ import annotations

import os

from radixfleet.engines.token_keys import TokenKeyer
from radixfleet.keys import Endpoint
from radixfleet.wire.errors import MalformedRequest

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "data", "vllm_token_ids.json")


MODEL = "tiny"


def router_ids(keyer: TokenKeyer, endpoint: str, body: dict):
    """('exact', ids) | ('unkeyed', reason) | ('malformed', param) for one case."""
    if endpoint == "tokenize":
        ep = Endpoint.CHAT if "messages" in body else Endpoint.COMPLETIONS
        if ep is Endpoint.CHAT:
            body = {"add_special_tokens": False, **body}
    else:
        ep = Endpoint.CHAT if endpoint == "chat" else Endpoint.COMPLETIONS
    try:
        key = keyer.key(ep, {"model": MODEL, **body}, block_size=32)
    except MalformedRequest as exc:
        return "malformed", exc.param
    if key.unkeyed is not None:
        return "unkeyed", key.unkeyed
    return "exact", list(key.token_ids)


def check_case(keyer: TokenKeyer, case: dict) -> None:
    """Asserts the router's answer to one recorded (or live) case."""
    name, expect = case["name"], case["expect"]
    kind, got = router_ids(keyer, case["endpoint"], case["body"])
    assert kind == expect, f"{name}: router {kind} ({got!r}), expected {expect}"
    if expect == "exact":
        assert case["status"] == 200, f"{name}: engine answered {case['status']}"
        assert got == case["ids"], f"{name}: ids differ\n router {got}\n engine {case['ids']}"
    elif expect == "malformed":
        assert case["status"] == 400, f"{name}: engine answered {case['status']}, not 400"
        assert got, f"{name}: MalformedRequest without a param"
