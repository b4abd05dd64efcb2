"""The offline fleet simulator: the real policies, index, radix caches and engine cost
model, on a virtual clock, in one process (``radixfleet simulate``).

Modules::

    prompts.py      RequestSpec / trace record -> SimPrompt (radix-cache key, router
                    hashes, token counts) at text level or block level
    blocktrace.py   Mooncake traces at block level (hash ids, no text)
    reference.py    oracle and pooled caches (the report's reference hit rates)
    driver.py       the load generator's session driver in virtual time
    engine.py       one simulated worker: the agent's scheduler + radix cache + cost model
    agentlink.py    a simulated agent's batches into the router's live feedback path
    simulation.py   the discrete-event simulation: router side, workers, feedback
    disagg.py       a disaggregated fleet: prefill workers, KV transfer, decode workers
    scaling_loop.py the autoscaling loop closed in the simulator (flash crowd)
    harness.py      the route core over FIFO prefill servers (PickLoop: policy tests,
                    bench policy --quality)
    sweep.py        sweeps over kv_tokens / workers / rate, and their plots
    cli.py          the command line
"""
