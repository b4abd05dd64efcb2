"""What the router, the policies, the agent and the load generator agree on: prefix
keys (``prefix_keys``, contract 1), the agents' event and load wire format
(``events``, contract 2), the bus messages (``bus_wire``), the one strict JSON parse
(``strict_json``) and the error types every layer raises (``errors``).
It imports nothing of the project's: everything else may import it.
"""
