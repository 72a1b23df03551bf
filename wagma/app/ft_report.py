"""What an ``ft=torchft`` job reports of itself: ``summary.json`` from its replicas' ``final`` records.

Written by the launcher (:mod:`wagma.app.ft_launch`) for the replicas it ran, and under torchrun by a replica
group's rank 0 for its own group (:mod:`wagma.app.ft_torchrun`). The keys are those of the application's summary
(:data:`wagma.app.metrics.SUMMARY_KEYS`, so ``format_summary`` and the sweep tables read it) plus ``ft``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from wagma.app.network import rate_burst, rate_name

__all__ = ["ft_summary"]


def ft_summary(
    cfg: DictConfig,
    finals: dict[int, dict[str, Any]],
    lives: dict[int, int],
    late: list[int],
    phases: tuple[float, float],
) -> dict[str, Any]:
    """``summary.json`` of an ft job from its replicas' ``final`` records: the lowest finished replica's test
    accuracy (all finished replicas hold the same model), the throughput and time split of the replicas' last lives,
    and ``ft``: the rounds, who finished, the final checksums, each replica's lives and heals, the late ones.
    ``phases``: seconds from the start to the job's first round (start-up), and from there to the end."""
    first = finals[min(finals)]
    totals = [f["totals"] for f in finals.values()]
    steps_run = max(1, max(t["steps"] for t in totals))
    slowest_s = max(t["train_s"] for t in totals)
    rounds, sync_period = int(cfg.steps) // int(cfg.ft.period), int(cfg.ft.sync_period)
    per_step = len(totals) * steps_run
    return {
        "policy": "torchft_wagma",
        "world_size": int(cfg.replicas),
        "steps": int(cfg.steps),
        "test_accuracy": first["test_accuracy"],
        "test_loss": first["test_loss"],
        "samples_per_s": sum(t["samples"] for t in totals) / slowest_s if slowest_s > 0 else None,
        "mean_wait_s": sum(t["wait_s"] for t in totals) / per_step,
        "mean_step_s": sum(t["train_s"] for t in totals) / per_step,
        "global_reductions": rounds // sync_period,
        "local_reductions": rounds - rounds // sync_period,
        "staleness": 0.0,
        "staleness_max": 0,
        "startup_s": phases[0],
        "train_s": phases[1],
        "wall_s": sum(phases),
        "guard": {"ok": True, "warnings": []},
        "dataset": str(cfg.data.name),
        "model": str(cfg.model.name),
        "imbalance": str(cfg.imbalance.name),
        "run_dir": str(cfg.run_dir),
        "rank_cpus": float(cfg.get("rank_cpus") or 0.0),  # each replica process's CPU quota (0: none)
        "rank_net": rate_name(cfg.get("rank_net")),  # each replica's link rate (None: loopback)
        "rank_net_burst": rate_burst(cfg.get("rank_net")),  # its shaper's bucket in bytes (None: loopback)
        "ft": {
            "rounds": rounds,
            "finished": sorted(finals),
            "checksums": {str(r): f["checksum"] for r, f in finals.items()},
            "lives": {str(r): n for r, n in lives.items()},
            "heals": {str(r): f["heals"] for r, f in finals.items()},
            "late": late,
        },
    }
