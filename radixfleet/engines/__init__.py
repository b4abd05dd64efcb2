"""The inference engines a worker can be: our agent, vLLM, SGLang, or any
OpenAI-compatible server (contract 7, docs/DESIGN.md). Each kind's adapter
(``adapters/``) says where its cache events come from, where its load comes from,
how a request is keyed for it and what its P/D leg looks like; ``radixfleet/server/app.py``
knows only that narrow interface.

Modules::

    kinds           worker kinds, and probing a worker for its kind and models
    adapters/       one adapter per kind: cache truth, load, keys, P/D leg
    link, manager   EngineLink per worker (its lifecycle); Engines: the links, key spaces
    link_keys       which tokenizer keys a worker, and why
    answers         what a finished request teaches a worker's link
    link_view       a link's /admin/workers view
    keyspace        byte and token key spaces, matches merged (contract 8)
    token_keys      exact keys: the engine's tokenizer -> token-block keys
    tokenizer_source  the tokenizer an engine names, read here or not, probed
    engine_keys     exact keys through the engine's /tokenize (no tokenizer here)
    chat_render     chat templates rendered as vLLM renders them
    piece_encoder   an exact, cached text -> token ids encoder (fast tokenizers)
    kv_events       vLLM/SGLang KV-event msgpack decoding
    zmq_events      the ZMQ subscriber (sequence gaps, replay, resets)
    block_map       engine block hashes re-keyed into the index, per rank
    wiring          subscriber -> block map -> index, per worker
    event_sources   a vLLM server's own /kv_event_sources
    engine_metrics  /metrics parsing and the per-worker scraper (contract 10)
    queue_estimate  an engine's waiting queue priced in prefill tokens
    prefill_rate    prefill speed learned per worker
    tier_price      a colder-tier hit's load-back price, learned per worker and tier
    accuracy        predicted vs reported cached tokens
    capacity        approximate mode's correction and learned KV capacity
"""
