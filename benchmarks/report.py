"""The benchmark's outputs besides the JSON: a markdown table with the targets, and PNG plots.

- ``results.md``: settings, one row per (scenario, policy), the targets (WAGMA's and eager-SGD's samples/s against
  DDP and the ideal, time to target and accuracy gap; :func:`check_targets`) checked against the measured ratios,
  the skipped policies with their reasons, and how each number is computed.
- ``accuracy_vs_time.png``: test accuracy against training time, one panel per scenario, one line per policy.
- ``throughput.png``: samples/s per scenario and policy, the no-wait ideal of each scenario marked.
- ``consensus.png``: consensus distance over time (only when some run recorded it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import results_io

__all__ = ["check_targets", "plot_accuracy", "plot_consensus", "plot_throughput", "write_markdown"]

Record = dict[str, Any]


def _find(records: Sequence[Record], scenario: str, policy: str) -> Record | None:
    for r in records:
        if r["scenario"] == scenario and r["policy"] == policy and r["status"] == "ok":
            return r
    return None


def _target(name: str, measured: float | None, op: str, threshold: float, why_missing: str) -> dict[str, Any]:
    if measured is None:
        status = "n/a"
    elif op == ">=":
        status = "met" if measured >= threshold else "missed"
    else:
        status = "met" if measured <= threshold else "missed"
    return {
        "target": name,
        "measured": measured,
        "op": op,
        "threshold": threshold,
        "status": status,
        "note": why_missing if measured is None else "",
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def check_targets(records: Sequence[Record], baseline: str = "allreduce") -> list[dict[str, Any]]:
    """The targets of WAGMA and eager-SGD against DDP (samples/s, the ideal's share, time to target, accuracy gap
    under random_k1; samples/s without imbalance), as measured in this run (ratios side by side, same data and
    imbalance)."""

    def rec(scenario: str, policy: str) -> Record | None:
        return _find(records, scenario, policy)

    def missing(scenario: str, *policies: str) -> str:
        absent = [p for p in policies if rec(scenario, p) is None]
        return f"not run in {scenario}: {', '.join(absent)}" if absent else "no value (target never reached?)"

    out = []
    ddp1, w1, solo1 = (rec("random_k1", p) for p in (baseline, "wagma", "eager_solo"))
    get = lambda r, key: None if r is None else r.get(key)  # noqa: E731
    out.append(
        _target(
            "random_k1: wagma samples/s / DDP",
            _ratio(get(w1, "samples_per_s"), get(ddp1, "samples_per_s")),
            ">=",
            1.6,
            missing("random_k1", "wagma", baseline),
        )
    )
    out.append(
        _target("random_k1: wagma samples/s / ideal", get(w1, "ideal_ratio"), ">=", 0.85, missing("random_k1", "wagma"))
    )
    out.append(
        _target(
            "random_k1: eager_solo samples/s / DDP",
            _ratio(get(solo1, "samples_per_s"), get(ddp1, "samples_per_s")),
            ">=",
            1.4,
            missing("random_k1", "eager_solo", baseline),
        )
    )
    out.append(
        _target(
            "random_k1: wagma time-to-target / DDP",
            _ratio(get(w1, "time_to_target_s"), get(ddp1, "time_to_target_s")),
            "<=",
            0.7,
            missing("random_k1", "wagma", baseline),
        )
    )
    acc_gap = None
    if get(w1, "final_accuracy") is not None and get(ddp1, "final_accuracy") is not None:
        acc_gap = 100.0 * (get(ddp1, "final_accuracy") - get(w1, "final_accuracy"))
    out.append(
        _target(
            "random_k1: DDP final accuracy - wagma's (points)",
            acc_gap,
            "<=",
            1.0,
            missing("random_k1", "wagma", baseline),
        )
    )
    ddp0 = rec("none", baseline)
    for policy in ("wagma", "eager_solo", "eager_majority"):
        r = rec("none", policy)
        out.append(
            _target(
                f"none: {policy} samples/s / DDP",
                _ratio(get(r, "samples_per_s"), get(ddp0, "samples_per_s")),
                ">=",
                0.9,
                missing("none", policy, baseline),
            )
        )
    return out


# --- markdown ------------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, fmt)


def _staleness(hist: dict[str, int] | None) -> str:
    if not hist:
        return "–"
    total = sum(hist.values())
    mean = sum(int(k) * v for k, v in hist.items()) / total if total else 0.0
    return f"{mean:.2f} / {max(int(k) for k in hist)}"


def _share(cal: dict[str, Any]) -> str:
    if not cal.get("compute_s") or not cal.get("step_s"):
        return ""
    return (
        f" ({100 * cal['compute_s'] / cal['step_s']:.0f} % of the step; the rest is DDP's allreduce and waiting: "
        "policies that communicate less gain from that alone)"
    )


def _isolation(settings: dict[str, Any]) -> str:
    """``, each rank capped at C CPUs, on its own R link`` for the settings' ``rank_cpus`` / ``rank_net`` (older
    results have neither: no quota, loopback)."""
    parts = []
    if settings.get("rank_cpus"):
        parts.append(f"each rank capped at {settings['rank_cpus']:g} CPUs (`rank_cpus`)")
    if settings.get("rank_net"):
        parts.append(f"each rank on its own {settings['rank_net']} link (`rank_net`)")
    return "".join(f", {part}" for part in parts)


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    """Write ``results.md`` for a finished benchmark ``result`` (the dict saved as JSON)."""
    s, m, cal = result["settings"], result["machine"], result["calibration"]
    target = s["target_accuracy"]
    lines = [
        f"# wagma policy benchmark ({result['mode']} mode)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_count']} CPUs ({m.get('cpu_model') or 'unknown model'}), {m['platform']}, Python "
        f"{m['python']}, torch {m['torch']}, commit `{m['git_commit']}`; load average at start "
        f"{m.get('load_average_start')}, at end {m.get('load_average_end')}.  ",
        f"Run: {s['world_size']} gloo CPU ranks (forked, `wagma.testing.run_workers`), {s['dataset']} / {s['model']} / "
        f"{s['optim']}, batch {s['batch_size']} per rank, {s['steps']} steps = {s['sample_budget']:,} samples, "
        f"test accuracy every {s['eval_every']} steps, seed {s['seed']}{_isolation(s)}; "
        f"{result['duration_s']:.0f} s in all.  ",
        f"Step time T = {1e3 * cal['step_s']:.2f} ms ({cal['source']}); compute part "
        f"{_num(cal.get('compute_s'), '.2f', 1e3)} ms{_share(cal)}. Scenario delay d = {1e3 * cal['delay_s']:.2f} ms "
        "(random_k ranks sleep d: about one step time).",
        "",
        "## Results",
        "",
        f"| scenario | policy | samples/s | ideal | ×ideal | ×DDP | t→{target:g} (s) | ×DDP | final acc | "
        "wait mean / p95 (ms) | global red. | KB/rank | staleness mean / max | consensus |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    skipped = []
    for r in result["records"]:
        if r["status"] != "ok":
            skipped.append(r)
            continue
        lines.append(
            f"| {r['scenario']} | {r['policy']} | {_num(r['samples_per_s'], ',.0f')} | "
            f"{_num(r['ideal_samples_per_s'], ',.0f')} | {_num(r['ideal_ratio'], '.2f')} | "
            f"{_num(r['ddp_ratio'], '.2f')} | "
            f"{_num(r['time_to_target_s'], '.2f')} | {_num(r['ttt_ddp_ratio'], '.2f')} | "
            f"{_num(r['final_accuracy'], '.4f')} | "
            f"{_num(r['mean_wait_s'], '.1f', 1e3)} / {_num(r['p95_wait_s'], '.1f', 1e3)} | "
            f"{_num(r['global_reductions'], '.0f')} | {_num(r['bytes_per_rank'], ',.0f', 1e-3)} | "
            f"{_staleness(r['staleness_hist'])} | {_num(r['final_consensus'], '.3g')} |"
        )
    lines += [
        "",
        "## Targets (measured side by side in this run)",
        "",
        "| target | measured | wanted | status |",
        "|---|---:|---:|---|",
    ]
    for t in result["targets"]:
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(
            f"| {t['target']} | {_num(t['measured'], '.2f')} | {t['op']} {t['threshold']:g} | {t['status']}{note} |"
        )
    if skipped:
        lines += ["", "## Not run", ""]
        by_reason: dict[tuple[str, str, str], list[str]] = {}
        for r in skipped:
            by_reason.setdefault((r["policy"], r["status"], r["reason"]), []).append(r["scenario"])
        for (policy, status, reason), scenarios in by_reason.items():
            first = reason.strip().splitlines()[-1] if status == "failed" else reason
            lines.append(f"- `{policy}` ({status}; {', '.join(scenarios)}): {first}")
    lines += ["", "## Scenarios", ""]
    for name, sc in result["scenarios"].items():
        lines.append(
            f"- `{name}`: {sc['description']}; expected delay per step: "
            f"mean {1e3 * sc['expected_mean_delay_s']:.2f} ms, "
            f"max over ranks {1e3 * sc['expected_max_delay_s']:.2f} ms; "
            f"ideal {sc['ideal_samples_per_s']:,.0f} samples/s."
        )
    lines += ["", "## How the numbers are computed", "", *(f"- {line}" for line in result["definitions"]), ""]
    path.write_text("\n".join(lines), encoding="utf-8")


# --- plots ---------------------------------------------------------------------------------------------


def _colors(policies: Sequence[str]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


def plot_accuracy(
    path: Path, records: Sequence[Record], scenarios: Sequence[str], policies: Sequence[str], target: float
) -> None:
    """Test accuracy against training time (slowest rank, evaluation excluded), one panel per scenario."""
    colors = _colors(policies)
    ncols = min(3, len(scenarios))
    nrows = -(-len(scenarios) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        lowest = 1.0
        for policy in policies:
            r = _find(records, scenario, policy)
            if r is None or not r["accuracy_curve"]:
                continue
            t = [p["time_s"] for p in r["accuracy_curve"]]
            a = [p["accuracy"] for p in r["accuracy_curve"]]
            lowest = min(lowest, *a[len(a) // 4 :])
            ax.plot(t, a, marker="o", markersize=2.5, linewidth=1.4, color=colors[policy], label=policy)
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:g}")
        ax.set_ylim(max(0.0, min(lowest, target) - 0.05), 1.0)
        _label_time_panel(ax, scenario, "test accuracy")
    _finish_grid(fig, axes, len(scenarios), path)


def _label_time_panel(ax: Any, scenario: str, ylabel: str) -> None:
    """Title, axis labels and grid of one scenario's panel against training time."""
    ax.set_xlim(left=0)
    ax.set_title(scenario)
    ax.set_xlabel("training time (s, slowest rank)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _finish_grid(fig: Any, axes: Any, used: int, path: Path) -> None:
    """Blank the unused panels of a grid, put one legend under it, save it to ``path`` and close it."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    results_io.save_plot(fig, path)
    plt.close(fig)


def ms_per_step_panel(
    ax: Any,
    lines: dict[str, list[tuple[int, float]]],
    ideal: list[tuple[int, float]],
    colors: dict[str, Any],
    title: str,
    ylabel: str,
) -> None:
    """One panel of ms per step against P (log2 axis): a line per policy, the no-wait ideal dashed.

    ``lines`` maps a policy to its (P, ms) points; policies without points are left out.
    """
    for policy, pts in lines.items():
        if pts:
            ax.plot(*zip(*sorted(pts), strict=True), marker="o", color=colors[policy], label=policy)
    if ideal:
        ax.plot(*zip(*sorted(ideal), strict=True), linestyle="--", color="black", label="no-wait ideal")
    worlds = sorted({w for pts in [*lines.values(), ideal] for w, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.minorticks_off()
    ax.set_title(title)
    ax.set_xlabel("ranks P")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_throughput(
    path: Path,
    records: Sequence[Record],
    scenarios: Sequence[str],
    policies: Sequence[str],
    ideals: dict[str, float | None],
) -> None:
    """Grouped bars of samples/s per scenario and policy; each scenario's no-wait ideal as a black line."""
    colors = _colors(policies)
    ran = [p for p in policies if any(_find(records, s, p) for s in scenarios)]
    width = 0.8 / max(1, len(ran))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(scenarios) * max(2, len(ran)) * 0.55 + 2), 4.6))
    top = 0.0
    for i, scenario in enumerate(scenarios):
        for j, policy in enumerate(ran):
            r = _find(records, scenario, policy)
            if r is None or r["samples_per_s"] is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, r["samples_per_s"], width * 0.92, color=colors[policy], label=policy if i == 0 else None)
            if r.get("ideal_ratio") is not None:
                ax.text(
                    x,
                    r["samples_per_s"],
                    f"{r['ideal_ratio']:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90 if len(ran) > 4 else 0,
                    zorder=4,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85},
                )
            top = max(top, r["samples_per_s"])
        ideal = ideals.get(scenario)
        if ideal:
            ax.hlines(
                ideal,
                i - 0.45,
                i + 0.45,
                colors="black",
                linewidth=2,
                zorder=3,
                label="no-wait ideal" if i == 0 else None,
            )
            top = max(top, ideal)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylim(0, top * 1.18 if top else 1)
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title("Throughput per scenario\n(black line: no-wait ideal; number on a bar: fraction of it)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=min(8, len(ran) + 1), frameon=False)
    fig.tight_layout()
    results_io.save_plot(fig, path)
    plt.close(fig)


def plot_consensus(path: Path, records: Sequence[Record], scenarios: Sequence[str], policies: Sequence[str]) -> bool:
    """Consensus distance against training time per scenario; False (nothing written) when no run has it.

    The y axis is logarithmic down to the smallest positive value and linear below it, so DDP's exact 0
    shows at the bottom.
    """
    with_data = [s for s in scenarios if any((r := _find(records, s, p)) and r.get("consensus") for p in policies)]
    if not with_data:
        return False
    positive = [
        p["consensus"]
        for r in records
        if r["status"] == "ok" and r.get("consensus")
        for p in r["consensus"]
        if p["consensus"] > 0
    ]
    linthresh = 10.0 ** math.floor(math.log10(min(positive))) if positive else 1e-12
    colors = _colors(policies)
    ncols = min(3, len(with_data))
    nrows = -(-len(with_data) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, scenario in zip(axes.flat, with_data, strict=False):
        for policy in policies:
            r = _find(records, scenario, policy)
            if r is None or not r.get("consensus"):
                continue
            pts = [(p["time_s"], p["consensus"]) for p in r["consensus"] if p["time_s"] is not None]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    marker="o",
                    markersize=2.5,
                    linewidth=1.2,
                    color=colors[policy],
                    label=policy,
                )
        ax.set_yscale("symlog", linthresh=linthresh)
        _label_time_panel(ax, scenario, "(1/P) Σ ‖w_i − w̄‖²")
    _finish_grid(fig, axes, len(with_data), path)
    return True
