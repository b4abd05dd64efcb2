"""What the router, the policies, the agent and the load generator agree on. It
imports nothing of the project's: everything else may import it.

Modules::

    prefix_keys  a request -> chained block hashes (contract 1, docs/DESIGN.md)
    events       the agents' event and load wire format (contract 2)
    bus_wire     what travels on the NATS bus: subjects, bodies, signatures (contract 11)
    identifiers  bounds on worker ids, epochs, model names, URLs, request ids
    errors       the exception tree and the OpenAI-style error body
    openapi      the OpenAPI documents of the router and the agent
    settings     the declared-schema layer (pydantic): fields with bounds and docs, errors
                 collected with dotted paths; router config and policy params use it
    extras       require(): a missing pip extra is one line naming it
    cli_args     the help formatter, case-insensitive --log-level, deprecated flag aliases
    strict_json  the one RFC 8259 parse (finite numbers) the HTTP bodies and the bus share
"""
