"""Adapters for the inference engines a worker can be: our agent, vLLM, SGLang, or any
OpenAI-compatible server (contract 7, docs/DESIGN.md). Each kind says where its cache events come from
(engine KV events, agent pushes, or none), where its load comes from (its Prometheus
``/metrics`` page or the agent's reports, always with the router's own pick-time counts)
and how a request is keyed for it; ``router/app.py`` knows only that narrow interface.
"""
