"""radixfleet/server/edge.py: the P/D fields a client may not set, and no answer carries back."""

from __future__ import annotations

import json

import pytest

from radixfleet.server.edge import ROUTER_FIELDS, check_request, scrub_answer
from radixfleet.server.sse import StreamWatch
from radixfleet.wire.errors import MalformedRequest

LEAK = {"do_remote_prefill": True, "remote_engine_id": "w-7", "remote_host": "10.0.0.7", "remote_port": 5600}


@pytest.mark.parametrize("field", ROUTER_FIELDS)
def test_a_client_setting_a_router_field_is_refused_naming_it(field):
    body = {"model": "m", "prompt": "x", field: {"do_remote_decode": True} if field.startswith("kv") else 3}
    with pytest.raises(MalformedRequest) as e:
        check_request(body)
    assert e.value.status == 400 and e.value.param == field
    assert field in str(e.value) and "router" in str(e.value)
    check_request({**body, field: None})  # null: not set, to vLLM and SGLang alike


def test_ordinary_bodies_pass():
    for body in ({"model": "m", "prompt": "x"}, {"text": "x", "sampling_params": {}}, [], "x"):
        check_request(body)


def test_a_non_streamed_answer_loses_the_hand_off_fields_and_keeps_the_rest():
    answer = {
        "id": "c",
        "choices": [{"text": "ok"}],
        "usage": {"prompt_tokens": 3},
        "kv_transfer_params": LEAK,
    }
    out = json.loads(scrub_answer(json.dumps(answer).encode()))
    assert out == {k: v for k, v in answer.items() if k != "kv_transfer_params"}
    plain = json.dumps({"id": "c", "choices": []}).encode()
    assert scrub_answer(plain) is plain  # no field: the same bytes, no parse
    odd = b'{"text": "the word \\"kv_transfer_params\\" in a completion"}'
    assert scrub_answer(odd) == odd  # named in a value, not a key: kept as it came
    assert scrub_answer(b'not json "kv_transfer_params"') == b'not json "kv_transfer_params"'


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_a_stream_event_loses_the_hand_off_fields_wherever_the_reads_cut(sep):
    events = [
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}',
        b'data: {"choices":[{"delta":{"content":"Hi"}}],"kv_transfer_params":'
        + json.dumps(LEAK).encode()
        + b"}",
        b'data: {"choices":[{"delta":{"content":"!"}}]}',
        b"data: [DONE]",
    ]
    stream = sep.join(events) + sep
    for cut in range(1, len(stream)):
        w = StreamWatch()
        out = w.feed(stream[:cut]) + w.feed(stream[cut:]) + w.flush()
        assert b"kv_transfer_params" not in out and b"10.0.0.7" not in out, (cut, out)
        texts = [e for e in out.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n") if e]
        payloads = [json.loads(e[6:]) for e in texts[:-1]]
        assert [p["choices"][0]["delta"] for p in payloads] == [
            {"role": "assistant"},
            {"content": "Hi"},
            {"content": "!"},
        ], (cut, out)
        assert texts[-1] == b"data: [DONE]" and w.first_token
