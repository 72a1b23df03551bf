"""Markdown and plots of the simulator's validation and extrapolation (:mod:`benchmarks.scale`).

- ``simulation.md``: the setting, the validation status and table (measured vs simulated), the
  extrapolated ms/step and speed-ups over allreduce per P, and the papers' claims beside them;
- ``simulation_scale.png``: simulated ms/step against P (64 ... 1,024) per policy, the no-wait ideal dashed;
- ``simulation_vs_measured.png``: simulated against measured ms/step with the ±10 % band (when measured),
  and hollow, the same runs simulated as if every rank had cores of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.report import _colors, _finish_grid, _num, ms_per_step_panel

__all__ = ["write_all", "write_markdown"]

Record = dict[str, Any]


def _paper(result: dict[str, Any]) -> list[Record]:
    return [r for r in result["records"] if r["source"] == "paper_setting"]


def _validation(result: dict[str, Any]) -> list[Record]:
    return [r for r in result["records"] if r["source"] == "validation"]


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    """Write ``simulation.md`` for ``result`` (the contents of ``simulation.json``)."""
    s = result["setting"]
    paper = _paper(result)
    lines = [
        "# Scale by simulation",
        "",
        f"Command: `{result['command']}` (commit `{result['machine']['git_commit']}`).",
        "",
        "The simulator (`benchmarks/simulate.py`, SimPy) replays per-rank compute and delay traces through each "
        "policy's protocol with an alpha-beta network model; groups and sync rounds come from the library's "
        "`GroupSchedule` and round rules.",
        "",
        "In the validation the ranks share this machine's cores, as they do in the real runs: each rank's recorded "
        "sleeps are durations, and its main thread's CPU time (forward/backward and optimizer step before the "
        "exchange, the policy's own work after it) and each collective's calibrated CPU per member are CPU work "
        "that the cores run round robin in the scheduler's time slice, measured on the machine. *own cores* is the "
        "same run simulated as if every rank had its "
        "own cores (the wall-clock trace and the idle world's wall-clock network as durations), the model used "
        "before; *CPU* is the CPU per rank and step, measured (every thread of the process) and as the model "
        "replays it. The extrapolation below gives every rank its own device, as in the paper.",
        "",
        "## Validation against the real runs (target: within ±10 %)",
        "",
        f"Status: **{result['validation']['status']}**.",
        "",
    ]
    val = _validation(result)
    if val:
        lines += [
            "| scenario | P | params | policy | measured ms | simulated ms | error | own cores: ms | error | "
            "CPU ms measured | modeled |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['scenario']} | {r['world_size']} | {r['params'] / 1e6:g} M | {r['policy']} | "
            f"{r['measured_ms']:.1f} | {r['simulated_ms']:.1f} | {100 * r['relative_error']:+.1f} % | "
            f"{_num(r.get('simulated_own_cores_ms'), '.1f')} | {_num(r.get('own_cores_error'), '+.1%')} | "
            f"{_num(r.get('cpu_ms'), '.1f')} | {_num(r.get('modeled_cpu_ms'), '.1f')} |"
            for r in val
        ]
    lines += [
        "",
        "## Extrapolation: the WAGMA paper's setting",
        "",
        f"ResNet-50 ({s['params']:,} parameters, {4 * s['params'] / 1e6:.1f} MB per allreduce), "
        f"{1e3 * s['compute_s']:.0f} ms "
        f"of forward + backward per step, {s['bandwidth_GBps']:g} GB/s injection bandwidth, {s['alpha_us']:g} µs "
        f"latency, each step k ranks (shared seed) sleep {1e3 * s['delay_s']:.0f} ms; {s['steps']} steps; WAGMA S = 8, "
        "τ = 10; other policies with their configs' defaults. random_k2: k = 2 at every P (the reference scripts); "
        "random_frac: k = P/32 (the same 2-of-64 fraction). Simulated, not measured.",
        "",
        "| scenario | P | policy | ms/step | ×allreduce | ×ideal |",
        "|---|---:|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['scenario']} | {r['world_size']} | {r['policy']} | {r['simulated_ms']:.1f} | "
        f"{r['x_allreduce']:.2f} | {r['x_ideal']:.2f} |"
        for r in paper
    ]
    lines += [
        "",
        "## Beside the papers' claims",
        "",
        "| claim | paper | simulated here (×allreduce, random_k2 / random_frac) |",
        "|---|---:|---|",
    ]
    for c in result["claims"]:
        got = [r for r in paper if r["policy"] == c["policy"] and r["world_size"] == c["world_size"]]
        sim = " / ".join(f"{r['x_allreduce']:.2f}" for r in got) or "not simulated"
        if c.get("versus") and got:
            sim += f"; ×the fastest of {', '.join(c['versus'])}: {_versus(paper, got, c['versus'])}"
        lines.append(f"| {c['what']} (P = {c['world_size']} here) | {c['claim']:.2f}× | {sim} |")
    lines += [
        "",
        "The claims' baselines and workloads differ from this setting (see each claim); the simulated "
        "ratio is against plain synchronous allreduce SGD on the same trace, and for a claim over the "
        "decentralized baselines also against the fastest of them simulated there.",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def _versus(paper: list[Record], got: list[Record], versus: list[str]) -> str:
    """Per record of ``got``, its speed-up over the fastest of the ``versus`` policies simulated at the same P and
    scenario, with that policy's name (``-`` where none of them was simulated)."""
    out = []
    for r in got:
        rivals = [
            q
            for q in paper
            if q["policy"] in versus and q["world_size"] == r["world_size"] and q["scenario"] == r["scenario"]
        ]
        best = min(rivals, key=lambda q: q["simulated_ms"], default=None)
        out.append("-" if best is None else f"{best['simulated_ms'] / r['simulated_ms']:.2f} ({best['policy']})")
    return " / ".join(out)


def plot_scale(path: Path, records: list[Record]) -> None:
    """Simulated ms/step against P per policy, one panel per scenario; the ideal dashed."""
    scenarios = list(dict.fromkeys(r["scenario"] for r in records))
    policies = list(dict.fromkeys(r["policy"] for r in records))
    colors = _colors(policies)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(max(11.0, 4.8 * len(scenarios)), 3.8), squeeze=False)
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        mine = [r for r in records if r["scenario"] == scenario]
        lines = {p: [(r["world_size"], r["simulated_ms"]) for r in mine if r["policy"] == p] for p in policies}
        ideal = sorted({(r["world_size"], r["ideal_ms"]) for r in mine})
        ms_per_step_panel(ax, lines, ideal, colors, f"{scenario} (simulated, paper setting)", "ms per step")
    _finish_grid(fig, axes, len(scenarios), path)


def plot_vs_measured(path: Path, records: list[Record]) -> None:
    """Simulated against measured ms/step, one colour per policy, the ±10 % band shaded."""
    policies = list(dict.fromkeys(r["policy"] for r in records))
    colors = _colors(policies)
    fig, axes = plt.subplots(1, 1, figsize=(10.5, 6.5), squeeze=False)
    ax = axes[0, 0]
    own = [r for r in records if r.get("simulated_own_cores_ms") is not None]
    values = [v for r in records for v in (r["measured_ms"], r["simulated_ms"])]
    values += [r["simulated_own_cores_ms"] for r in own]
    lo, top = 0.85 * min(values), 1.1 * max(values)
    ax.fill_between([lo, top], [0.9 * lo, 0.9 * top], [1.1 * lo, 1.1 * top], color="grey", alpha=0.2, label="±10 %")
    ax.plot([lo, top], [lo, top], color="black", linewidth=1)
    if own:
        ax.scatter(
            [r["measured_ms"] for r in own],
            [r["simulated_own_cores_ms"] for r in own],
            s=18,
            facecolors="none",
            edgecolors="grey",
            label="same runs, ranks with cores of their own",
        )
    for policy in policies:
        mine = [r for r in records if r["policy"] == policy]
        ax.scatter(
            [r["measured_ms"] for r in mine],
            [r["simulated_ms"] for r in mine],
            s=18,
            color=colors[policy],
            label=policy,
        )
    ax.set_xlim(lo, top)
    ax.set_ylim(lo, top)
    ax.set_xlabel("measured ms per step")
    ax.set_ylabel("simulated ms per step")
    ax.set_title("Simulator vs real runs (every scenario, P, policy)")
    ax.grid(alpha=0.3)
    _finish_grid(fig, axes, 1, path)


def write_all(out: Path, result: dict[str, Any]) -> list[Path]:
    """Write ``simulation.md`` and the plots into ``out``; return the paths written."""
    written = [out / "simulation.md"]
    write_markdown(written[0], result)
    if _paper(result):
        plot_scale(out / "simulation_scale.png", _paper(result))
        written.append(out / "simulation_scale.png")
    if _validation(result):
        plot_vs_measured(out / "simulation_vs_measured.png", _validation(result))
        written.append(out / "simulation_vs_measured.png")
    return written
