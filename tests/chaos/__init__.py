"""The chaos suite: probes an attacker or a broken peer on loopback could send, against a
live router process, each asserting the expected answer and that the router's memory and
open file descriptors stay bounded and come back near their baseline
(``radixfleet_tools/harness/router_process.py``); schemathesis fuzzing of a live fleet (test_fuzz.py) and a
router crashed and restarted (test_fault_restart.py)."""
