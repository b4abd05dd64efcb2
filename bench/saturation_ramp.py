"""A Mooncake-format trace of the shape where exact eviction news used to scatter
tenants: G groups, each with its own P-block shared prefix (512-token blocks, as the
Mooncake trace) plus one unique block per request, Zipf-like group popularity, and
Poisson arrivals whose rate ramps linearly from r0 to r1 req/s over the duration.

    python3 bench/saturation_ramp.py OUT GROUPS PREFIX_BLOCKS R0 R1 DURATION_S SEED [ZIPF_ALPHA]

then ``radixfleet simulate --trace OUT --agents 8 --kv-tokens 32000 --policies
prefix_load,cache_aware --feedback events,plain --slo ttft_ms=2000`` (goodput: requests
within 2 s of TTFT per second; bench/RESULTS.md, "Past saturation")."""

import json
import random
import sys

out, G, P, r0, r1, T, seed = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    float(sys.argv[4]),
    float(sys.argv[5]),
    float(sys.argv[6]),
    int(sys.argv[7]),
)
alpha = float(sys.argv[8]) if len(sys.argv) > 8 else 0.0
rng = random.Random(seed)
w = [1.0 / (g + 1) ** alpha for g in range(G)]
t = 0.0
nid = G * P
n = 0
with open(out, "w") as f:
    while True:
        r = r0 + (r1 - r0) * t / T
        t += rng.expovariate(r)
        if t >= T:
            break
        g = rng.choices(range(G), w)[0]
        ids = list(range(g * P, g * P + P)) + [nid]
        nid += 1
        f.write(
            json.dumps(
                {
                    "timestamp": int(t * 1000),
                    "input_length": (P + 1) * 512 - rng.randint(0, 400),
                    "output_length": rng.randint(32, 256),
                    "hash_ids": ids,
                }
            )
            + "\n"
        )
        n += 1
print(n, "requests")
