"""Disaggregated prefill/decode through the live router (radixfleet.route.pd), against a fake
vLLM prefill/decode pair that keeps vLLM's ``kv_transfer_params`` protocol
(tests/fake_vllm_pd.py): the two legs in order with the params forwarded, streaming,
short requests colocated, prefix-aware prefill choice, retries and their limits,
cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.harness.procs import free_port
from tests.fake_vllm_pd import FakeState, fake_app

pytestmark = pytest.mark.integration

HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}
LONG = "You are a careful assistant. " * 80  # ~2400 bytes: many blocks, long uncached part


@contextlib.asynccontextmanager
async def pd_fleet(
    roles: dict[str, str], *, policy: str = "prefix_load", colocate: int = 100, sglang: bool = False, **extra
):
    """Fake workers named and roled by ``roles``, behind a started router (``sglang``:
    SGLang's protocol, each prefill worker's bootstrap port its own)."""
    runners, states, workers = [], {}, []
    for name, role in roles.items():
        st = states[name] = FakeState(name, role, port=free_port(), sglang=sglang, bootstrap_port=free_port())
        r = web.AppRunner(fake_app(st), access_log=None)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", st.port).start()
        runners.append(r)
        workers.append(
            {
                "url": f"http://127.0.0.1:{st.port}",
                "id": name,
                "role": role,
                "kind": "sglang" if sglang else "openai",
                "model": "m",
                "bootstrap_port": st.bootstrap_port,
                "metrics": {"path": ""},
            }
        )
    router = Router(
        parse_config(
            {
                "workers": workers,
                "health": HEALTH,
                "policy": {"name": policy},
                "disagg": {"colocate_below_tokens": colocate},
                "response_headers": {"worker_id": True},
                **extra,
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    deadline = time.monotonic() + 5
    while len(router.pool.views(time.monotonic())) < len(roles):
        assert time.monotonic() < deadline, "workers never turned healthy"
        await asyncio.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    _ADMIN[url] = f"http://127.0.0.1:{server.admin_port}"
    try:
        yield url, states
    finally:
        del _ADMIN[url]
        await server.aclose()
        for r in runners:
            await r.cleanup()


def _prefill_legs(st: FakeState) -> list[dict]:
    return [b for b in st.requests if (b.get("kv_transfer_params") or {}).get("do_remote_decode")]


async def test_two_legs_in_order_with_params_forwarded():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.headers["x-radixfleet-worker"] == "d1"
        body = r.json()
        # the decode worker pulled the prefill worker's blocks: the whole prompt cached
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"]
        (pre,) = st["p1"].requests
        assert pre["max_tokens"] == 1 and pre["stream"] is False
        assert pre["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        (dec,) = st["d1"].requests
        assert dec["max_tokens"] == 5 and dec["prompt"] == LONG
        kv = dec["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "p1"
        assert kv["remote_port"] == st["p1"].port and st["p1"].held == {}  # pulled


async def test_streaming_goes_through_the_decode_leg():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        async with httpx.AsyncClient() as c:
            payload = {
                "model": "m",
                "prompt": LONG,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await c.post(f"{url}/v1/completions", json=payload)
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
        assert texts == ["d", "d", "d"]
        usage = json.loads(events[-2])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
        (pre,) = st["p1"].requests
        assert pre["stream"] is False and "stream_options" not in pre
        assert st["d1"].requests[0]["stream"] is True


async def test_a_short_request_skips_the_prefill_pool():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}, colocate=200) as (url, st):
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert st["p1"].requests == []
            (dec,) = st["d1"].requests
            assert "kv_transfer_params" not in dec
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
            assert r.status_code == 200 and len(st["p1"].requests) == 1


async def test_a_next_turn_cached_on_its_decode_worker_runs_there():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        async with httpx.AsyncClient() as c:
            for turn in ("", " and then?"):
                r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG + turn})
                assert r.status_code == 200, r.text
        assert len(st["p1"].requests) == 1  # the second turn: colocated on d1
        assert "kv_transfer_params" not in st["d1"].requests[1]


async def test_the_same_prefix_goes_to_the_same_prefill_worker():
    roles = {"p1": "prefill", "p2": "prefill", "p3": "prefill", "d1": "decode"}
    async with pd_fleet(roles, colocate=0) as (url, st):  # never colocated
        async with httpx.AsyncClient() as c:
            for i in range(4):
                r = await c.post(
                    f"{url}/v1/completions", json={"model": "m", "prompt": LONG + f"q{i}", "max_tokens": 1}
                )
                assert r.status_code == 200, r.text
        used = [n for n in ("p1", "p2", "p3") if st[n].requests]
        assert len(used) == 1, {n: len(st[n].requests) for n in ("p1", "p2", "p3")}
        assert len(st[used[0]].requests) == 4


async def test_a_failed_prefill_leg_is_retried_on_another_prefill_worker():
    async with pd_fleet(
        {"p1": "prefill", "p2": "prefill", "d1": "decode"}, policy="round_robin", colocate=0
    ) as (url, st):
        st["p1"].mode = "fail"
        async with httpx.AsyncClient() as c:
            for _ in range(2):
                r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG})
                assert r.status_code == 200, r.text
        assert len(st["p1"].requests) >= 1  # tried, failed
        assert len(st["p2"].requests) == 2
        assert [d["kv_transfer_params"]["remote_engine_id"] for d in st["d1"].requests] == ["p2", "p2"]


async def test_every_prefill_worker_failing_is_a_502_and_no_decode():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        st["p1"].mode = "fail"
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG})
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        assert st["d1"].requests == []


async def test_a_decode_leg_that_started_is_not_run_twice():
    async with pd_fleet({"p1": "prefill", "d1": "decode", "d2": "decode"}) as (url, st):
        st["d1"].mode = st["d2"].mode = "break"
        async with httpx.AsyncClient() as c:
            r = await c.post(
                f"{url}/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 4, "stream": True}
            )
        assert r.status_code == 200
        assert '"upstream_failed"' in r.text and r.text.endswith("data: [DONE]\n\n")
        assert len(st["d1"].requests) + len(st["d2"].requests) == 1
        assert len(st["p1"].requests) == 1  # nor its prefill


async def test_a_client_gone_during_the_prefill_leg_cancels_it_and_no_decode_runs():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        st["p1"].mode, st["p1"].delay_s = "slow", 3.0
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG}, timeout=0.3)
        deadline = time.monotonic() + 2
        while st["p1"].hung_up == 0:
            assert time.monotonic() < deadline, "the prefill leg was not cancelled"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert st["d1"].requests == []


async def test_a_client_gone_during_the_decode_leg_cancels_it():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        st["d1"].mode, st["d1"].delay_s = "slow_stream", 0.1
        payload = {"model": "m", "prompt": LONG, "max_tokens": 200, "stream": True}
        async with httpx.AsyncClient() as c:
            async with c.stream("POST", f"{url}/v1/completions", json=payload) as r:
                async for _ in r.aiter_bytes():
                    break  # the first chunk, then hang up
        deadline = time.monotonic() + 3
        while st["d1"].hung_up == 0:
            assert time.monotonic() < deadline, "the decode leg was not cancelled"
            await asyncio.sleep(0.02)


async def test_a_pool_of_decode_workers_only_serves_colocated():
    # an agent may register as prefill while the only other worker is decode: the
    # config cannot refuse what is learned at run time, so a pool left with decode
    # workers alone runs requests on them
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        st["p1"].mode = "fail"
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 200 and st["p1"].requests == []


#: a running pd_fleet's data-port URL -> its admin listener's
_ADMIN: dict[str, str] = {}


async def _drain(c: httpx.AsyncClient, url: str, wid: str) -> None:
    r = await c.post(f"{_ADMIN[url]}/admin/workers/{wid}/drain", json={"drain": True})
    assert r.status_code == 200, r.text


async def test_no_decode_worker_available_is_a_503_with_retry_after_and_no_leg_runs():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        async with httpx.AsyncClient() as c:
            await _drain(c, url, "d1")
            r = await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG})
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert "no decode worker" in r.json()["error"]["message"]
        assert st["p1"].requests == [] and st["d1"].requests == []


async def test_decode_workers_gone_during_the_prefill_leg_is_a_503_with_retry_after_and_no_decode():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}) as (url, st):
        st["p1"].mode, st["p1"].delay_s = "slow", 0.5
        async with httpx.AsyncClient() as c:
            sent = asyncio.create_task(
                c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG}, timeout=10)
            )
            deadline = time.monotonic() + 2
            while not st["p1"].requests:
                assert time.monotonic() < deadline, "the prefill leg never arrived"
                await asyncio.sleep(0.01)
            await _drain(c, url, "d1")
            r = await sent
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert len(_prefill_legs(st["p1"])) == 1 and st["d1"].requests == []


async def test_sglang_both_legs_at_once_paired_by_a_bootstrap_room():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}, sglang=True) as (url, st):
        async with httpx.AsyncClient() as c:
            payload = {"model": "m", "prompt": LONG, "max_tokens": 3, "stream": True}
            r = await c.post(f"{url}/v1/completions", json=payload)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
        assert r.text.count('"text": "d"') == 3
        (pre,), (dec,) = st["p1"].requests, st["d1"].requests
        room = pre["bootstrap_room"]
        assert dec["bootstrap_room"] == room and 0 <= room < 2**63
        assert (pre["bootstrap_host"], pre["bootstrap_port"]) == ("127.0.0.1", st["p1"].bootstrap_port)
        assert (dec["bootstrap_host"], dec["bootstrap_port"]) == ("127.0.0.1", st["p1"].bootstrap_port)
        assert pre["stream"] is False and dec["stream"] is True
        assert "kv_transfer_params" not in pre and "kv_transfer_params" not in dec


async def test_sglang_a_client_gone_cancels_both_legs():
    async with pd_fleet({"p1": "prefill", "d1": "decode"}, sglang=True) as (url, st):
        st["p1"].mode, st["p1"].delay_s = "slow", 3.0  # the decode leg waits for its room
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(f"{url}/v1/completions", json={"model": "m", "prompt": LONG}, timeout=0.3)
        deadline = time.monotonic() + 2
        while st["p1"].hung_up == 0:
            assert time.monotonic() < deadline, "the prefill leg was not cancelled"
            await asyncio.sleep(0.02)


async def test_both_legs_carry_the_class_to_workers_that_schedule_by_priority():
    async with pd_fleet(
        {"p1": "prefill", "d1": "decode"},
        models={"m": {"priority_field": True}},
        tenancy={"default_priority": "standard"},
    ) as (url, st):
        async with httpx.AsyncClient() as c:
            r = await c.post(
                f"{url}/v1/completions",
                json={"model": "m", "prompt": LONG, "max_tokens": 5, "priority": -1},
                headers={"x-radixfleet-priority": "sheddable"},
            )
        assert r.status_code == 200, r.text
        (pre,) = st["p1"].requests
        (dec,) = st["d1"].requests
        assert pre["priority"] == dec["priority"] == 2  # the class, not the client's -1
