"""An agent's events reach the router before its answer ends, so the router's index
predicts a conversation's next turn exactly (radixfleet.engines.accuracy), however soon
the turn follows the answer."""

from __future__ import annotations

import httpx
import pytest

from tests.router.fleet import fleet  # noqa: F401  (fleet: the fixture)

pytestmark = pytest.mark.integration

SYSTEM = "You are the assistant of a shop that sells bicycles and their parts. " * 30
#: whole 32-token blocks of answer: missing from the index, each turn is off by this
ANSWER_TOKENS = 96


async def _conversation(c: httpx.AsyncClient, url: str, who: str, turns: int, stream: bool) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"{who} asks question {t}: which chain fits?"})
        body = {"model": "m", "messages": messages, "max_tokens": ANSWER_TOKENS, "stream": stream}
        if not stream:
            r = await c.post(url, json=body)
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]["content"]
        else:
            parts = []
            async with c.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        import json

                        for ch in json.loads(line[6:])["choices"]:
                            parts.append(ch["delta"].get("content") or "")
            answer = "".join(parts)
        # the next turn goes at once, as a client with the answer in hand sends it
        messages.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize("stream", [False, True])
async def test_the_next_turn_is_predicted_exactly(fleet, stream):  # noqa: F811
    await fleet.start({"policy": {"name": "prefix_load"}})
    await fleet.agent("m")
    await fleet.routable(1)
    url = fleet.base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as c:
        for who in ("ann", "bob"):
            await _conversation(c, url, who, 5, stream)
    (link,) = fleet.router.engines.links.values()
    acc = link.stats.summary()
    assert acc.samples == 10
    # exact events: what is left is the block under the prompt's last whole block
    # (the agent caches by token, the index by 32-token block)
    assert acc.mean_abs_blocks < 1.0, acc
    assert acc.over == 0, acc
