"""The worker agent: what the router routes to.

::

    server.py  (aiohttp: OpenAI API, SGLang probes, /metrics)
       |  routing_bytes -> tokenizer.encode -> SchedRequest
       v
    engine.py  (real-time driver: step, sleep the simulated duration, deliver)
       v
    scheduler.py  (synchronous continuous batching; also driven in virtual time
       |           by the offline simulator)
       +-- radix_cache.py  token radix tree: locks, LRU leaf eviction, admission,
       |                   router-space block hashes -> stored/removed events
       +-- kv_pool.py      one token budget shared by the tree and running requests
       +-- dram_tier.py    host-memory KV below the tree: 256-token chunks, PCIe
       |                   copies on their own streams, own LRU, admission gate
       '-- cost_model.py   every GPU/model constant, with its source
    reporter.py  (events + load -> every router, snapshots on (re)connect)
    router_link.py  (one router's stream: epoch, sequence, resnapshot)
    bus.py       (the same batches published once on the NATS bus, --bus)
    tokenizer.py (the deterministic byte-chunk tokenizer)
    cli.py       (``radixfleet agent``)
"""
