"""Goodput and the Markdown summary of :mod:`benchmarks.ft_campaign`'s records."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

#: The fault-free mode each faulted mode is measured against (``restart`` falls back to ``none``).
REFERENCE = {"none": "none", "live": "none", "restart_none": "restart_none", "restart": "restart_none"}


#: The modes without faults: their run does not depend on the faults' rate, so one serves every MTBF.
FAULT_FREE = ("none", "restart_none")


def cell(record: dict[str, Any], mode: str | None = None) -> tuple[Any, ...]:
    """What identifies a run of ``mode`` (the record's own by default): P, MTBF (None for a fault-free mode,
    whatever the record says: older files gave their references the rate of their file), seed, steps, mode."""
    mode = mode or record["mode"]
    mtbf = None if mode in FAULT_FREE else record["mtbf_s"]
    return record["replicas"], mtbf, record["seed"], record["steps"], mode


def with_goodput(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with ``goodput`` (the reference's wall time, same P, seed and steps, over this run's) and
    ``accuracy_gap`` (this run's test accuracy minus the reference's); None where either is missing."""
    by_key = {cell(r): r for r in records}
    out = []
    for r in records:
        ref = by_key.get(cell(r, REFERENCE[r["mode"]])) or by_key.get(cell(r, "none"))
        wall, ref_wall = r.get("wall_s"), ref and ref.get("wall_s")
        goodput = round(ref_wall / wall, 3) if wall and ref_wall else None
        acc, ref_acc = r.get("test_accuracy"), ref and ref.get("test_accuracy")
        gap = round(acc - ref_acc, 4) if acc is not None and ref_acc is not None else None
        out.append(r | {"goodput": goodput, "accuracy_gap": gap})
    return out


def _span(values: list[float], digits: int = 3) -> str:
    """``median (min-max)`` of ``values``; blank without any."""
    if not values:
        return ""
    med = statistics.median(values)
    return (
        f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
        if len(values) > 1
        else f"{med:.{digits}f}"
    )


def _row(group: list[dict[str, Any]]) -> str:
    """One table row: runs, hangs, named faults, goodput, recovery, lost steps, survivors failed, accuracy, its gap."""
    r0 = group[0]
    faults = [f for r in group for f in r["faults"]]
    recov = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
    # not back, in a run that ended on its own: the job trained to its end before the victim was back
    ended_first = sum(f["recovery_s"] is None for r in group if not r["hung"] for f in r["faults"])
    back = f"{len(recov)}/{len(faults)}" + (f" ({ended_first} ended first)" if ended_first else "")
    cells = [
        f"{r0['replicas']}", "-" if cell(r0)[1] is None else f"{r0['mtbf_s']:g}", r0["mode"], str(len(group)),
        str(sum(r["hung"] for r in group)),
        str(len(faults)), f"{sum(f['named'] for f in faults)}/{len(faults)}",
        back if faults else "",
        _span([r["goodput"] for r in group if r["goodput"] is not None]),
        f"{statistics.median(recov):.1f} / {max(recov):.1f}" if recov else "",
        f"{max(f['lost'] for f in faults)}" if faults else "",
        _failed(group),
        _span([r["test_accuracy"] for r in group if r["test_accuracy"] is not None], 4),
        _span([r["accuracy_gap"] for r in group if r["accuracy_gap"] is not None], 4),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _failed(group: list[dict[str, Any]]) -> str:
    """Live modes: survivor lives that failed (not killed by the harness) over the runs that recorded them."""
    read = [r for r in group if "survivor_exits" in r]
    if not read:
        return ""
    unread = len(group) - len(read)
    return str(sum(len(r["survivor_exits"]) for r in read)) + (f" ({unread} runs not read)" if unread else "")


def markdown(records: list[dict[str, Any]], command: str, repo: Path) -> str:
    """The campaign's summary: per P, MTBF and mode, with the machine and the exact command."""
    from benchmarks.machine import machine_info

    info = machine_info(repo)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    order = {m: i for i, m in enumerate(REFERENCE)}
    for r in sorted(records, key=lambda r: (r["replicas"], cell(r)[1] or 0.0, order[r["mode"]], r["seed"])):
        groups.setdefault(cell(r)[:2] + (r["mode"],), []).append(r)
    lines = [
        "# Live recovery against restarting everyone on `python train.py` (benchmarks/ft_campaign.py)",
        "",
        f"    {command}",
        "",
        f"Machine: {info['cpu_count']} CPUs ({info['cpus_usable']} usable), {info['cpu_model']}, {info['platform']},",
        f"Python {info['python']}, torch {info['torch']}, commit {info['git_commit']}, load average at the summary"
        f" {info['load_average_start']}.",
        "",
        "| P | MTBF (s) | mode | runs | hung | faults | named | back | goodput median (range) "
        "| recovery median / max (s) | most steps lost by survivors | survivors failed | test accuracy "
        "| gap to fault-free |",
        "|---:|---:|---|---:|---:|---:|---|---|---|---|---:|---|---|---|",
        *[_row(group) for group in groups.values()],
        "",
        "Goodput: the fault-free reference's wall time (same P, seed and steps; one reference serves every MTBF;"
        " `live` against `none`, `restart`"
        " against `restart_none`) over this run's, from the first training step to the job's end. Recovery: from"
        " the kill until the victim's next life ran a round in the quorum (live) or rank 0 trained again (restart);"
        " 'ended first': the job trained to its end before the victim was back."
        " Steps lost: live, the most rounds (of one step) one survivor discarded while the victim was down;"
        " restart, steps past the resumed checkpoint that rank 0's flushed metrics showed at the kill (a lower"
        " bound). Survivors failed: live, replica lives the harness did not kill that ended with a nonzero status"
        " (the launcher started them again; recorded since the harness read them). Named: the job's output names"
        " the victim (live: the launcher's warning with its replica and pid).",
        "",
    ]  # fmt: skip
    return "\n".join(lines)
