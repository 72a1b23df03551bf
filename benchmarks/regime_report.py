"""Markdown and plots of the compute-bound regime benchmark (:mod:`benchmarks.regime`).

- ``regime.md``: how it was run (command, machine, settings), one row per (params, scenario, P, policy)
  with ms/step, ideal, bound, simulated ms/step and the ratios, and how each number is computed;
- ``regime_ms_per_step.png``: ms/step against P, one panel per scenario, one line per policy, the
  no-wait ideal dashed (the model size with most records);
- ``regime_x_ideal.png``: fraction of the no-wait ideal per policy, bars per P, one panel per scenario;
- ``regime_params.png``: ms/step against model size, where several sizes ran.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.report import _colors, _finish_grid, _num, ms_per_step_panel
from benchmarks.simulate import no_wait_ms

__all__ = ["write_all", "write_markdown"]

Record = dict[str, Any]

DEFINITIONS: tuple[str, ...] = (
    "ms/step: from a barrier after the warm-up steps to a barrier after the last step and the policy's finalize "
    "(final global mean, or eager-SGD's flush of the residuals), max end − min start over ranks, / timed steps; "
    "median of the repetitions.",
    "ideal: T + the mean over ranks and steps of the delays the ranks actually slept (docs/design.md §4: a perfectly "
    "wait-avoiding method pays the mean delay, not the maximum). ×ideal = ideal / ms.",
    "no-wait: T + the largest total delay any one rank slept, / steps: what ranks that never wait for each other "
    "(nor communicate) take on the same trace. Every protocol's bound is at or above it, so ideal / no-wait is the "
    "most ×ideal any policy can reach over this many steps; it tends to 1 as the steps grow.",
    "bound: the policy's protocol bound, benchmarks.simulate.protocol_bound on the same recorded delay trace: "
    "zero-cost communication and exactly T of compute per step, so only the waits the protocol itself demands "
    "remain (DDP: the slowest rank every step; local SGD / hierarchical: the slowest cumulative delay at each "
    "blocking mean; WAGMA: async rounds never wait, each sync round waits for the largest cumulative delay since "
    "the last; eager solo: rounds need the fastest rank, majority the round's initiator, sync rounds everyone). "
    "×bound = bound / ms: what the implementation keeps of what its protocol permits.",
    "bound (cores): the protocol's best on this machine: each rank's recorded sleeps, then its compute's CPU time "
    "on the cores all ranks share (as sim shares them), free communication and no averaging work; ×bound (cores) "
    "= that / ms: what communication and the policy's own work cost here.",
    "bound (trace): the same protocol bound on each rank's recorded compute (the sleeps plus its real "
    "forward/backward and optimizer step, which ranks sharing 2 cores slow down) instead of exactly T; "
    "×bound (trace) = that / ms: what communication and the implementation lose.",
    "sim: benchmarks.simulate.simulate with the ranks sharing this machine's cores (round robin in the scheduler's "
    "time slice, measured on the machine: benchmarks.machine.scheduler_slice_s; processor sharing where none was "
    "measured): per rank "
    "and step the recorded sleeps, then as CPU work the main thread's CPU time of the forward/backward and "
    "optimizer step before the exchange and of the policy's own work after it; a collective costs each member the "
    "CPU an allreduce of 1 float and of the model took in the same world before training (5 samples each, median "
    "of the mean over ranks, linear in the bytes), scaled so that the collectives' total is the CPU the run's "
    "other threads used (comm_scale). Records from before this model (no `cores` field) hold the "
    "own-cores model's number: the recorded wall-clock trace and the calibration's wall-clock times as durations.",
    "×DDP: DDP's ms / the policy's ms, same scenario, P and model (median of each first).",
)


def _sizes(records: Sequence[Record]) -> list[int]:
    return sorted({r["params"] for r in records})


def _main_size(records: Sequence[Record]) -> int:
    return Counter(r["params"] for r in records).most_common(1)[0][0]


def _ok(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r.get("status") == "ok"]


def _steps(record: Record, result: dict[str, Any]) -> int:
    """The timed steps behind ``record`` (records written before they carried it: its invocation's setting)."""
    if "steps" in record:
        return int(record["steps"])
    return int(result["invocations"][record["invocation"]]["settings"]["steps"])


def _no_wait(record: Record, result: dict[str, Any]) -> float | None:
    """``record``'s no-wait time; for a record from before it was stored, the median over its repetitions'
    recorded delay traces (T + the largest total delay of one rank / steps), or None without them."""
    if "no_wait_ms" in record:
        return float(record["no_wait_ms"])
    key = ("scenario", "policy", "world_size", "params", "compute_ms")
    values = [
        no_wait_ms(record["compute_ms"] / 1e3, np.array(rep["delays_ms"]) / 1e3)
        for rep in result.get("reps", [])
        if all(rep.get(k) == record[k] for k in key) and rep.get("delays_ms")
    ]
    return statistics.median(values) if values else None


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    """Write ``regime.md`` for ``result`` (the contents of ``regime.json``)."""
    lines = ["# The compute-bound regime: policies under stragglers", ""]
    for inv in result["invocations"]:
        m, s = inv["machine"], inv["settings"]
        lines += [
            f"- `{inv['command']}`: {m['cpu_count']} CPUs ({m.get('cpu_model') or 'unknown model'}), "
            f"torch {m['torch']}, "
            f"commit `{m['git_commit']}`, load average at start {m.get('load_average_start')}, at end "
            f"{inv.get('load_average_end')}; T = {s['compute_ms']:g} ms emulated compute (a sleep), {s['steps']} timed "
            f"steps after {s['warmup']} warm-up steps, batch {s['batch_size']}, {s['reps']} repetition(s); "
            f"{_num(inv.get('duration_s'), '.0f')} s.",
        ]
    for again in result.get("resimulations", []):
        measured = again.get("slice_s_measured")
        slice_note = f"; the scheduler's time slice measured then: {1e3 * measured:.2f} ms" if measured else ""
        lines.append(
            f"- `{again['command']}` (commit `{again['machine']['git_commit']}`): the shared-cores "
            f"simulation (sim) redone from the stored traces, no run{slice_note}."
        )
    lines += [
        "",
        "## Results",
        "",
        "| params | scenario | P | steps | policy | ms/step | ideal | no-wait | bound | sim | ×DDP | ×ideal | ×bound "
        "| ×bound (trace) | ×bound (cores) | sim/measured |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    failed = []
    for r in sorted(result["records"], key=lambda r: (r["params"], r["scenario"], r["world_size"])):
        if r.get("status") != "ok":
            failed.append(r)
            continue
        lines.append(
            f"| {r['params']:,} | {r['scenario']} | {r['world_size']} | {_steps(r, result)} | {r['policy']} | "
            f"{r['ms_per_step']:.1f} | {r['ideal_ms']:.1f} | {_num(_no_wait(r, result), '.1f')} | "
            f"{r['bound_ms']:.1f} | {r['simulated_ms']:.1f} | {_num(r['x_ddp'], '.2f')} | "
            f"{r['x_ideal']:.2f} | {r['x_bound']:.2f} | {_num(r.get('x_bound_trace'), '.2f')} | "
            f"{_num(r.get('x_bound_cores'), '.2f')} | {r['simulated_ms'] / r['ms_per_step']:.2f} |"
        )
    split = [r for r in result["records"] if r.get("status") == "ok" and "breakdown_ms" in r]
    cores = result["invocations"][-1]["machine"]["cpu_count"] if result["invocations"] else 1
    if split:
        lines += [
            "",
            "## Where a step goes",
            "",
            "Means over ranks and steps, ms (medians of the repetitions): the sleeps (T + injected delay), the real "
            "forward/backward/step, the policy on the main thread (waits included), the final mean or flush per "
            "step, and the slowest rank's excess over the mean (ms/step minus the rest); then the CPU time per rank "
            "and step (every thread of the rank), and P x that / the machine's cores, a floor under ms/step.",
            "",
            "| params | scenario | P | policy | ms/step | sleeps | compute | averaging | finalize | excess | CPU/rank "
            "| CPU floor |",
            "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(split, key=lambda r: (r["params"], r["scenario"], r["world_size"])):
            b = r["breakdown_ms"]
            excess = r["ms_per_step"] - sum(b.values())
            cpu = r.get("cpu_ms")
            # The cores the record's own run could use (recorded since the shared-cores model), else the machine's.
            floor = None if cpu is None else cpu * r["world_size"] / (r.get("cores") or cores)
            lines.append(
                f"| {r['params']:,} | {r['scenario']} | {r['world_size']} | {r['policy']} | {r['ms_per_step']:.1f} | "
                f"{b['sleeps']:.1f} | {b['compute']:.1f} | {b['averaging']:.1f} | {b['finalize']:.1f} | {excess:.1f} | "
                f"{_num(cpu, '.1f')} | {_num(floor, '.1f')} |"
            )
    if failed:
        lines += ["", "## Failed or skipped", ""]
        lines += [
            f"- {r['scenario']} / {r['policy']} / P={r['world_size']}: {r.get('reason', '')[-300:]}" for r in failed
        ]
    lines += ["", "## How the numbers are computed", ""] + [f"- {d}" for d in DEFINITIONS] + [""]
    path.write_text("\n".join(lines), encoding="utf-8")


def _panels(n: int, width: float = 4.6, height: float = 3.6) -> tuple[Any, Any]:
    ncols = min(2, n)
    nrows = -(-n // ncols)
    return plt.subplots(nrows, ncols, figsize=(max(11.0, width * ncols), height * nrows), squeeze=False)


def plot_ms_per_step(path: Path, records: Sequence[Record]) -> None:
    """ms/step against P per scenario (the most common model size), the ideal dashed."""
    size = _main_size(records)
    recs = [r for r in records if r["params"] == size]
    scenarios = list(dict.fromkeys(r["scenario"] for r in recs))
    policies = list(dict.fromkeys(r["policy"] for r in recs))
    colors = _colors(policies)
    fig, axes = _panels(len(scenarios))
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        mine = [r for r in recs if r["scenario"] == scenario]
        lines = {p: [(r["world_size"], r["ms_per_step"]) for r in mine if r["policy"] == p] for p in policies}
        ideal = sorted({(r["world_size"], r["ideal_ms"]) for r in mine if r["policy"] == "allreduce"})
        ms_per_step_panel(ax, lines, ideal, colors, f"{scenario} ({size:,} params)", "ms per step (slowest rank)")
    _finish_grid(fig, axes, len(scenarios), path)


def plot_x_ideal(path: Path, records: Sequence[Record]) -> None:
    """Fraction of the no-wait ideal per policy: bars per P, one panel per scenario."""
    size = _main_size(records)
    recs = [r for r in records if r["params"] == size]
    scenarios = list(dict.fromkeys(r["scenario"] for r in recs))
    policies = list(dict.fromkeys(r["policy"] for r in recs))
    worlds = sorted({r["world_size"] for r in recs})
    colors = _colors(policies)
    width = 0.8 / len(policies)
    fig, axes = _panels(len(scenarios))
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        for j, policy in enumerate(policies):
            for i, world in enumerate(worlds):
                r = next(
                    (r for r in recs if (r["scenario"], r["policy"], r["world_size"]) == (scenario, policy, world)),
                    None,
                )
                if r is not None:
                    ax.bar(
                        i - 0.4 + width * (j + 0.5),
                        r["x_ideal"],
                        width * 0.92,
                        color=colors[policy],
                        label=policy if i == 0 else None,
                    )
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(worlds)), [f"P={w}" for w in worlds])
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{scenario}: fraction of the no-wait ideal")
        ax.grid(axis="y", alpha=0.3)
    _finish_grid(fig, axes, len(scenarios), path)


def plot_params(path: Path, records: Sequence[Record]) -> bool:
    """ms/step against model size for each (scenario, P) that ran several sizes; False when none did."""
    sizes: dict[tuple[str, int], set[int]] = {}
    for r in records:
        sizes.setdefault((r["scenario"], r["world_size"]), set()).add(r["params"])
    groups = sorted(key for key, found in sizes.items() if len(found) > 1)
    if not groups:
        return False
    policies = list(dict.fromkeys(r["policy"] for r in records))
    colors = _colors(policies)
    fig, axes = _panels(len(groups))
    for ax, (scenario, world) in zip(axes.flat, groups, strict=False):
        for policy in policies:
            pts = sorted(
                (r["params"], r["ms_per_step"])
                for r in records
                if (r["scenario"], r["world_size"], r["policy"]) == (scenario, world, policy)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=colors[policy], label=policy)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{scenario}, P={world}")
        ax.set_xlabel("parameters")
        ax.set_ylabel("ms per step")
        ax.grid(alpha=0.3)
    _finish_grid(fig, axes, len(groups), path)
    return True


def write_all(out: Path, result: dict[str, Any]) -> list[Path]:
    """Write ``regime.md`` and the plots into ``out``; return the paths written."""
    written = [out / "regime.md"]
    write_markdown(written[0], result)
    records = _ok(result["records"])
    if records:
        plot_ms_per_step(out / "regime_ms_per_step.png", records)
        plot_x_ideal(out / "regime_x_ideal.png", records)
        written += [out / "regime_ms_per_step.png", out / "regime_x_ideal.png"]
        if plot_params(out / "regime_params.png", records):
            written.append(out / "regime_params.png")
    return written
