"""Load generation and reports: what the fleet does to traffic whose prefixes repeat.

Modules (each imports only what it needs; the simulator reuses the first four)::

    workloads    deterministic sessions of RequestSpecs (gsp, multiturn, zipf, rag,
                 agent, mixed, pollution, trace) -- make_workload(name, options, seed)
    arrivals     Poisson / TraceTimes / Closed arrivals within Bounds; drive()
    report       summarize() -> one run of the shared {"runs": [...]} schema,
                 CacheReference (oracle + pooled), validate(), tables, plots
    prefix_trie  the token radix tree behind the oracle
    client       Target: the async streaming OpenAI client, one Result per request
    trace_format Mooncake traces and traffic logs read into one record shape
    retry        the client's policy on refusals (the OpenAI SDK's, or none)
    metrics      TPOT, goodput, percentiles, per-request export, sweep table/plot
    datasets     --dataset random (vllm bench serve's) and sharegpt (a file)
    cli          `radixfleet loadtest` (A/B over --target NAME=URL): the CLI
    runner       run_ab: one workload and seed against each target in turn, cold
    defaults     the fleet and load the demo and `radixfleet simulate` share by default
    ab           the A/B runs on a local fleet (--ab radix|policy)
    smg          finding SGLang's gateway `smg` for an A/B arm
    local_fleet  `radixfleet up` (agents + router as child processes; the
                 simulator's virtual fleet is simulator/simulation.py)
    demo         `radixfleet demo` (one fleet, three policies, one comparison)
    analyze      `radixfleet analyze` of a traffic log (knee, Zipf head, replay)
    simulator/   the offline fleet simulator in virtual time
"""
