"""Tests of the engine links (radixfleet/engines/: vLLM and SGLang KV events, metrics, capacity,
queue estimate, token keys) and, marked ``engine``, against real vLLM servers that
vllm_env.py provisions (make_tiny_llama.py builds the tiny model)."""
