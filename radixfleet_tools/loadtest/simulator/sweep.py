"""Runs of one command: policies x feedback modes x sweep values, and their plots.

``plan_runs`` expands a base ``SimConfig`` into one ``RunPlan`` per combination, in
a fixed order (sweep value, then feedback mode, then policy), so a seed reproduces
the whole document. Each run's report names its policy (``name``), plus, when the
command varies more than the policy, a ``sweep`` field ``{"param", "value"}`` and a
feedback suffix (``prefix_load+none``).

Sweepable parameters::

    kv_tokens   KV capacity per worker, tokens (the knee plot: hit rate vs cache)
    workers     fleet size
    rate        Poisson arrival rate, requests/s (replaces the arrival process;
                a --rate run's --burstiness and --concurrency cap are kept)

Plots (``write_sweep_plots``): per swept parameter, hit rate against the value per
policy with the pooled and oracle references, and TTFT p50 against the value.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.loadtest.arrivals import Poisson
from radixfleet_tools.loadtest.report import require_plots

SWEEP_PARAMS = ("kv_tokens", "workers", "rate")


@dataclass(frozen=True, slots=True)
class Sweep:
    param: str
    values: tuple[float, ...]


def parse_sweep(text: str) -> Sweep:
    """``"kv_tokens=1000,2000"`` -> Sweep; raises ``ConfigError`` naming --sweep."""
    name, sep, rest = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in SWEEP_PARAMS:
        raise ConfigError(
            "--sweep", f"{text!r} must be NAME=V1,V2,... with NAME one of {', '.join(SWEEP_PARAMS)}"
        )
    values = []
    for part in rest.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part) if name == "rate" else int(part)
        except ValueError:
            raise ConfigError(
                "--sweep", f"{name} value {part!r} is not a {'number' if name == 'rate' else 'whole number'}"
            ) from None
        if not v > 0:
            raise ConfigError("--sweep", f"{name} values must be > 0, got {part}")
        values.append(v)
    if not values:
        raise ConfigError("--sweep", f"{text!r} lists no values")
    return Sweep(name, tuple(values))


@dataclass(frozen=True, slots=True)
class RunPlan:
    name: str
    cfg: Any  # SimConfig
    arrivals: Any
    sweep: dict | None


def plan_runs(
    base,
    policies: Sequence[str],
    feedback: Sequence[str],
    arrivals,
    sweep: Sweep | None,
    tiers: Sequence[str] = (),
) -> list[RunPlan]:
    """Every (sweep value, feedback mode, tiers mode, policy) combination, in that
    order. ``tiers``: values of the router config's ``index.tiers`` to run each of
    (``--index-tiers``; empty: the base config's), named ``<policy>+tiers=<mode>``."""
    out = []
    values = sweep.values if sweep is not None else (None,)
    for v in values:
        cfg, arr = base, arrivals
        if sweep is not None:
            assert v is not None, "a sweep's values are numbers"
            if sweep.param == "kv_tokens":
                cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kv_tokens=int(v)))
            elif sweep.param == "workers":
                cfg = dataclasses.replace(cfg, workers=int(v))
            else:
                # the base's burstiness and concurrency cap hold at every rate
                arr = (
                    dataclasses.replace(arrivals, rate=float(v))
                    if isinstance(arrivals, Poisson)
                    else Poisson(float(v))
                )
        for mode in feedback:
            for tier_mode in tiers or (None,):
                tcfg = cfg
                if tier_mode is not None:
                    rc = cfg.router_config
                    tcfg = dataclasses.replace(
                        cfg,
                        router_config=dataclasses.replace(
                            rc, index=dataclasses.replace(rc.index, tiers=tier_mode)
                        ),
                    )
                for policy in policies:
                    name = policy if len(feedback) == 1 else f"{policy}+{mode}"
                    if len(tiers) > 1:
                        name += f"+tiers={tier_mode}"
                    out.append(
                        RunPlan(
                            name,
                            dataclasses.replace(tcfg, policy=policy, feedback=mode),
                            arr,
                            {"param": sweep.param, "value": v} if sweep else None,
                        )
                    )
    return out


def write_sweep_plots(runs: list[dict], out_dir: str) -> list[str]:
    """PNG plots of a sweep's runs (those with a ``sweep`` field). Returns the paths."""
    require_plots()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = [r for r in runs if r.get("sweep")]
    if not swept:
        return []
    param = swept[0]["sweep"]["param"]
    os.makedirs(out_dir, exist_ok=True)
    names = list(dict.fromkeys(r["name"] for r in swept))
    label = {
        "kv_tokens": "KV capacity per worker (tokens)",
        "workers": "workers",
        "rate": "arrival rate (requests/s)",
    }[param]
    paths = []

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for n in names:
        rs = sorted((r for r in swept if r["name"] == n), key=lambda r: r["sweep"]["value"])
        ax.plot([r["sweep"]["value"] for r in rs], [r["hit_rate"] for r in rs], marker="o", label=n)
    ref: dict[float, tuple[float, float]] = {}
    for r in swept:  # references depend on the sweep value, not the policy
        ref.setdefault(r["sweep"]["value"], (r["pooled_hit_rate"], r["oracle_hit_rate"]))
    xs = sorted(ref)
    ax.plot(xs, [ref[x][0] or 0.0 for x in xs], "k--", label="pooled (one LRU cache, fleet capacity)")
    ax.plot(xs, [ref[x][1] for x in xs], "k:", label="oracle (unbounded)")
    if param == "kv_tokens":
        ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("hit rate (share of prompt tokens cached)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Hit rate vs {param}" + (" (the knee)" if param == "kv_tokens" else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(os.path.join(out_dir, f"sweep_{param}_hit_rate.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for n in names:
        rs = sorted((r for r in swept if r["name"] == n), key=lambda r: r["sweep"]["value"])
        ax.plot(
            [r["sweep"]["value"] for r in rs],
            [r["ttft_ms"]["p50"] or 0.0 for r in rs],
            marker="o",
            label=f"{n} p50",
        )
        ax.plot(
            [r["sweep"]["value"] for r in rs],
            [r["ttft_ms"]["p99"] or 0.0 for r in rs],
            marker="x",
            linestyle="--",
            label=f"{n} p99",
        )
    if param == "kv_tokens":
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("TTFT (ms, simulated, log)")
    ax.set_title(f"TTFT vs {param}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    paths.append(os.path.join(out_dir, f"sweep_{param}_ttft.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
