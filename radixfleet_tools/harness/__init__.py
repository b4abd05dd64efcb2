"""What the tests and the live benchmarks (bench/*.py) share to start and stop processes:
children on loopback ports, a router process, real vLLM servers (run from a checkout).

Modules:

- ``pressure``: A real-engine test bed under cache pressure: KV caches sized to the working set,
  and a CPU burner beside the engines.
- ``procs``: Starting and stopping real processes on loopback for integration tests.
- ``router_process``: A router in its own process for the chaos probes, and its resources read from
  /proc.
- ``vllm_env``: A real vLLM for the engine tests: its venv, a tiny model, servers on loopback.
- ``vllm_router``: A router's YAML in front of real vLLM servers and calls to it, for the engine
  tests.
"""
