"""``radixfleet bench saturation``: goodput past saturation, live, against SGLang's gateway.

The shape of ``bench/RESULTS.md`` "Past saturation" on a live fleet: many tenants,
each behind its own long system prompt (the ``zipf`` workload: ``--groups`` prompts
of ``--system-tokens`` with Zipf(``--alpha``) popularity, a unique suffix per
request), ``--agents`` simulated agents whose KV (``--kv-tokens`` each) holds most
but not all of the prompts at once, on a slow GPU preset (``l4``: the simulated
GPUs saturate, not this host's CPUs).

1. capacity: ``--calibrate-s`` of a closed loop (8 clients per agent, the OpenAI
   SDK's retries on 429) through ``radixfleet router`` at its defaults on fresh
   agents; capacity = requests served per second over the last two thirds of the
   window (the first third fills the caches). ``--capacity`` skips this.
2. arms, each on freshly started agents and a fresh router, open loop (Poisson) at
   ``--load`` x capacity for ``--duration`` s, requests in flight then given
   ``--drain`` s; a refusal is the request's outcome (no client retries):

   ``prefix_load``        radixfleet router, defaults (shedding on), agents send
                          events and load reports
   ``prefix_load_plain``  the same router, agents that send nothing (the router
                          ages and corrects its own index: ``--feedback plain``)
   ``smg``                SGLang's gateway, ``smg launch --policy cache_aware`` at
                          its defaults (no concurrency limit: every request is
                          forwarded, the excess queues at the workers)
   ``round_robin``        radixfleet router, round robin

   ``--repeats`` rounds; each round runs every arm once, the order rotated by one
   per round (so each arm runs first, last and between equally often over as many
   rounds as arms: a fleet started later in a round is not a different fleet).

Per run: requests offered, served, shed (429), other failures (a timeout, or
cancelled after the drain), hit rate (cached / prompt tokens of the served
requests, the agents' own counts), TTFT p50/p90/p99 of the served requests, and
goodput: requests served within ``--slo-ttft-ms`` of TTFT per second of the
offered window (the same denominator for every arm). Per arm: the median and
spread (min-max) over the rounds, and per round prefix_load's goodput over smg's
(a ratio within one round). ``--json`` prints one object. The binary ``smg``
is required when an smg arm runs (``radixfleet_tools.loadtest.smg.require_smg``: missing is an
error naming how to install it, before any process starts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig
from radixfleet_tools.loadtest.metrics import meets_slo
from radixfleet_tools.loadtest.report import percentiles, spread
from radixfleet_tools.loadtest.retry import RetryPolicy
from radixfleet_tools.loadtest.runner import run_ab
from radixfleet_tools.loadtest.workloads import make_workload

#: arm name -> (router policy or "smg", agents send nothing)
ARMS: dict[str, tuple[str, bool]] = {
    "prefix_load": ("prefix_load", False),
    "prefix_load_plain": ("prefix_load", True),
    "smg": ("smg", True),
    "round_robin": ("round_robin", False),
}
DEFAULT_ARMS = ",".join(ARMS)
#: closed-loop clients per agent while calibrating
CALIBRATE_CLIENTS = 8


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--agents", type=int, default=4, help="simulated agents (default: 4)")
    p.add_argument(
        "--agent-model", default="llama-3-8b", help="the agents' model preset (default: llama-3-8b)"
    )
    p.add_argument("--gpu", default="l4", help="the agents' GPU preset (default: l4)")
    p.add_argument("--kv-tokens", type=int, default=24_000, help="KV tokens per agent (default: 24,000)")
    p.add_argument("--groups", type=int, default=32, help="tenants, each its own system prompt (default: 32)")
    p.add_argument(
        "--system-tokens", type=int, default=4096, help="tokens of each system prompt (default: 4096)"
    )
    p.add_argument(
        "--suffix-tokens", type=int, default=64, help="tokens of each request's unique suffix (default: 64)"
    )
    p.add_argument("--output-tokens", type=int, default=16, help="max_tokens of each request (default: 16)")
    p.add_argument(
        "--alpha", type=float, default=0.6, help="Zipf exponent of the tenants' popularity (default: 0.6)"
    )
    p.add_argument(
        "--load", type=float, default=1.5, help="offered rate, x the calibrated capacity (default: 1.5)"
    )
    p.add_argument("--capacity", type=float, help="the fleet's capacity in req/s (skips calibration)")
    p.add_argument(
        "--calibrate-s",
        type=float,
        default=30.0,
        help="seconds of closed loop measuring capacity (default: 30)",
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per arm (default: 30)")
    p.add_argument(
        "--drain", type=float, default=10.0, help="grace for requests in flight after it (default: 10)"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds, the arm order rotated each (default: 3)")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default: {DEFAULT_ARMS})")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT bound (default: 2000)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    p.add_argument("--log-dir", help="where the fleet logs (default: a temp dir, removed)")


def check(args: argparse.Namespace) -> list[str]:
    """The arms in run order of the first round; raises ``ConfigError`` for a bad flag."""
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    for n in names:
        if n not in ARMS:
            raise ConfigError("--arms", f"unknown arm {n!r}; valid: {DEFAULT_ARMS}")
    if not names or len(set(names)) != len(names):
        raise ConfigError("--arms", "name one or more distinct arms, comma-separated")
    positive = {
        "--load": args.load,
        "--calibrate-s": args.calibrate_s,
        "--duration": args.duration,
        "--slo-ttft-ms": args.slo_ttft_ms,
        "--groups": args.groups,
        "--suffix-tokens": args.suffix_tokens,
        "--output-tokens": args.output_tokens,
        "--repeats": args.repeats,
        "--kv-tokens": args.kv_tokens,
    }
    for flag, v in positive.items():
        if not v > 0:
            raise ConfigError(flag, f"must be > 0, got {v:g}")
    if args.capacity is not None and not args.capacity > 0:
        raise ConfigError("--capacity", f"must be > 0 req/s, got {args.capacity:g}")
    if args.drain < 0 or args.system_tokens < 0 or args.alpha < 0:
        raise ConfigError("--drain/--system-tokens/--alpha", "must be >= 0")
    if not 1 <= args.agents <= 64:
        raise ConfigError("--agents", f"must be in [1, 64], got {args.agents}")
    if "smg" in names:
        from radixfleet_tools.loadtest.smg import require_smg

        require_smg()
    return names


def workload(args: argparse.Namespace, requests: int):
    return make_workload(
        "zipf",
        {
            "prompts": args.groups,
            "alpha": args.alpha,
            "system_tokens": args.system_tokens,
            "suffix_tokens": args.suffix_tokens,
            "output_tokens": args.output_tokens,
            "requests": max(1, requests),
            "api": "completions",
        },
        args.seed,
    )


class Bench:
    """One fleet configuration, started fresh for the calibration and for every run."""

    def __init__(self, args: argparse.Namespace, log_dir: str) -> None:
        self.args = args
        self.log_dir = log_dir
        self.runs = 0

    def fleet(self, arm: str) -> Fleet:
        """Fresh agents (plain for smg and the no-events arm) and the arm's router."""
        a = self.args
        policy, plain = ARMS[arm]
        self.runs += 1
        cfg = FleetConfig(
            agents=a.agents,
            model=a.agent_model,
            gpu=a.gpu,
            kv_tokens=a.kv_tokens,
            router_port=0,
            policy="prefix_load" if policy == "smg" else policy,
            plain_workers=plain,
        )
        fleet = Fleet(cfg, log_dir=os.path.join(self.log_dir, f"{self.runs:02d}-{arm}"), start_router=False)
        try:
            fleet.start_agents()
            if policy == "smg":
                from radixfleet_tools.loadtest.smg import launch_args

                fleet.start_smg(launch_args({}))
            else:
                fleet.start_router(policy)
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def drive(self, fleet: Fleet, name: str, arrivals, seconds: float, retry: RetryPolicy):
        a = self.args
        expected = (arrivals.rate if isinstance(arrivals, Poisson) else 100.0) * seconds
        (outcome,) = asyncio.run(
            run_ab(
                [(name, fleet.router_url)],
                workload(a, int(expected * 2) + 200),
                arrivals,
                Bounds(None, seconds, a.drain),
                flush_urls=fleet.agent_urls,
                kv_capacity_tokens=a.kv_tokens * a.agents,
                timeout_s=seconds + a.drain + 30.0,
                progress=False,
                retry=retry,
                admin_urls={fleet.router_url: fleet.admin_url},
            )
        )
        return outcome

    def calibrate(self) -> float:
        """Requests served per second by a saturated fleet behind the default router."""
        a = self.args
        fleet = self.fleet("prefix_load")
        try:
            o = self.drive(
                fleet, "calibrate", Closed(CALIBRATE_CLIENTS * a.agents), a.calibrate_s, RetryPolicy("sdk")
            )
        finally:
            fleet.stop()
        if not o.results:
            raise ConfigError("--calibrate-s", "no request was sent while calibrating")
        t0 = min(r.start for r in o.results)
        lo, hi = t0 + a.calibrate_s / 3.0, t0 + a.calibrate_s
        served = sum(1 for r in o.results if r.ok and r.e2e_s is not None and lo <= r.start + r.e2e_s <= hi)
        if served == 0:
            raise ConfigError("--calibrate-s", "nothing was served in the calibration window; give it longer")
        return served / (hi - lo)

    def run_arm(self, arm: str, rate: float) -> dict:
        a = self.args
        fleet = self.fleet(arm)
        try:
            o = self.drive(fleet, arm, Poisson(rate), a.duration, RetryPolicy("none"))
            reasons = None if ARMS[arm][0] == "smg" else decision_reasons(fleet.admin_url)
        finally:
            fleet.stop()
        out = measure(o.report, o.results, a.duration, a.slo_ttft_ms)
        if reasons is not None:
            out["reasons"] = reasons
        return out


def decision_reasons(admin_url: str) -> dict[str, int]:
    """Requests a worker answered with 200, by the policy's decision reason (affinity,
    spill_load, miss, ...), from the router's ``radixfleet_requests_total``: why the
    served requests went where they went. Empty when the metrics cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(admin_url + "/metrics", timeout=5.0).text  # the admin listener
    except httpx.HTTPError:
        return {}
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "radixfleet_requests":
            continue
        for sample in fam.samples:
            if sample.name.endswith("_total") and sample.labels.get("status") == "200":
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0) + int(sample.value)
    return dict(sorted(out.items()))


def measure(report: dict, results, window_s: float, slo_ttft_ms: float) -> dict:
    """One run's figures (the module docstring) from its report and results."""
    ok = [r for r in results if r.ok]
    shed = sum(1 for r in results if not r.ok and r.status == 429)
    good = sum(1 for r in results if meets_slo(r, {"ttft_ms": slo_ttft_ms}))
    ttft = percentiles([r.ttft_s for r in ok if r.ttft_s is not None], ps=(50.0, 90.0, 99.0))
    return {
        "offered": len(results),
        "served": len(ok),
        "shed_429": shed,
        "failed_other": len(results) - len(ok) - shed,
        "hit_rate": round(report["hit_rate"], 4),
        "pooled_hit_rate": report.get("pooled_hit_rate"),
        "ttft_ms": {
            k: (None if v is None else round(v, 1)) for k, v in ttft.items() if k in ("p50", "p90", "p99")
        },
        "goodput_rps": round(good / window_s, 3),
        "good": good,
    }


def _spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {k: round(v, 4) for k, v in spread(xs).items()}


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per arm: median and spread over the rounds; per round: prefix_load / smg goodput."""
    arms = {}
    for n in names:
        mine = [r for r in runs if r["arm"] == n]
        arms[n] = {
            "goodput_rps": _spread([r["goodput_rps"] for r in mine]),
            "hit_rate": _spread([r["hit_rate"] for r in mine]),
            "ttft_p50_ms": _spread([r["ttft_ms"].get("p50") for r in mine]),
            "ttft_p90_ms": _spread([r["ttft_ms"].get("p90") for r in mine]),
            "ttft_p99_ms": _spread([r["ttft_ms"].get("p99") for r in mine]),
            "shed_429": _spread([r["shed_429"] for r in mine]),
            "failed_other": _spread([r["failed_other"] for r in mine]),
        }
    ratios = []
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["arm"]: r for r in runs if r["round"] == rnd}
        if "prefix_load" in by and "smg" in by and by["smg"]["goodput_rps"]:
            ratios.append(by["prefix_load"]["goodput_rps"] / by["smg"]["goodput_rps"])
    return {"arms": arms, "prefix_load_over_smg_goodput": _spread(ratios)}


def measure_all(args: argparse.Namespace, log_dir: str, progress=None) -> dict:
    """Calibrates (unless ``--capacity``), runs every round; the ``--json`` object."""
    names = check(args)
    bench = Bench(args, log_dir)
    started = time.time()
    load_before = os.getloadavg()
    capacity = args.capacity if args.capacity is not None else bench.calibrate()
    rate = args.load * capacity
    if progress:
        progress(f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s ({args.load:g}x)")
    runs = []
    for rnd in range(args.repeats):
        k = rnd % len(names)
        for arm in names[k:] + names[:k]:
            fig = bench.run_arm(arm, rate)
            fig.update(arm=arm, round=rnd, load_average=round(os.getloadavg()[0], 2))
            runs.append(fig)
            if progress:
                progress(_line(fig))
    return {
        "agents": args.agents,
        "agent_model": args.agent_model,
        "gpu": args.gpu,
        "kv_tokens": args.kv_tokens,
        "workload": {
            "name": "zipf",
            "groups": args.groups,
            "system_tokens": args.system_tokens,
            "suffix_tokens": args.suffix_tokens,
            "output_tokens": args.output_tokens,
            "alpha": args.alpha,
            "seed": args.seed,
        },
        "capacity_rps": round(capacity, 3),
        "calibrated": args.capacity is None,
        "load": args.load,
        "rate_rps": round(rate, 3),
        "duration_s": args.duration,
        "slo_ttft_ms": args.slo_ttft_ms,
        "arms": names,
        "runs": runs,
        "summary": summarize(runs, names),
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "wall_s": round(time.time() - started, 1),
    }


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _line(r: dict) -> str:
    t = r["ttft_ms"]
    return (
        f"round {r['round']} {r['arm']:<18} offered {r['offered']:>4} served {r['served']:>4} "
        f"shed {r['shed_429']:>4} failed {r['failed_other']:>3}  hit {r['hit_rate']:.3f}  TTFT p50/p90/p99 "
        f"{_ms(t.get('p50'))}/{_ms(t.get('p90'))}/{_ms(t.get('p99'))} ms  goodput {r['goodput_rps']:.2f}/s  "
        f"(load {r['load_average']})" + (f"  reasons {r['reasons']}" if r.get("reasons") else "")
    )


def render(out: dict) -> str:
    w = out["workload"]
    lines = [
        f"fleet: {out['agents']} x {out['agent_model']} on {out['gpu']} (simulated), {out['kv_tokens']:,} KV "
        f"tokens each; zipf: {w['groups']} system prompts of {w['system_tokens']} tokens (alpha "
        f"{w['alpha']:g}) + {w['suffix_tokens']} unique, {w['output_tokens']} out",
        f"capacity {out['capacity_rps']:.2f} req/s ({'calibrated' if out['calibrated'] else 'given'}); "
        f"offered {out['rate_rps']:.2f} req/s ({out['load']:g}x) for {out['duration_s']:g} s; goodput: "
        f"TTFT <= {out['slo_ttft_ms']:g} ms",
        "",
        "arm                 goodput/s (spread)     hit (spread)           "
        "TTFT p50 / p90 / p99 ms (medians)  shed",
    ]
    for n, s in out["summary"]["arms"].items():
        g, h = s["goodput_rps"], s["hit_rate"]
        ps = " / ".join(
            _ms(s[f"ttft_{p}_ms"]["median"] if s[f"ttft_{p}_ms"] else None) for p in ("p50", "p90", "p99")
        )
        lines.append(
            f"{n:<19} {g['median']:.2f} ({g['min']:.2f}-{g['max']:.2f})".ljust(43)
            + f"{h['median']:.3f} ({h['min']:.3f}-{h['max']:.3f})".ljust(23)
            + f"{ps}".ljust(35)
            + f"{s['shed_429']['median']:g}"
        )
    r = out["summary"]["prefix_load_over_smg_goodput"]
    if r:
        lines.append(
            f"prefix_load / smg goodput, per round: median {r['median']:.3f}x "
            f"(spread {r['min']:.3f}-{r['max']:.3f})"
        )
    lines.append(f"load average before {out['load_average']['before']}, after {out['load_average']['after']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check(args)
    progress = None if args.json else (lambda s: print(s, flush=True))
    if args.log_dir:
        out = measure_all(args, args.log_dir, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="radixfleet-saturation-") as logs:
            out = measure_all(args, logs, progress)
    print(json.dumps(out) if args.json else render(out))
    return 0
