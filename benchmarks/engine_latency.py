"""Activation latency and round time of the wait-avoiding group allreduce on this machine.

    python benchmarks/engine_latency.py [--world 4] [--group 2] [--rounds 500] [--numel 1024] [--out FILE]

Each round, the first rank to arrive wins the trigger and records when (``triggered_at``); every other
rank's progress thread records when it saw the activation (``activated_at``). Activation latency is
``activated_at - triggered_at`` over all (round, non-winning rank) pairs; the clocks are the same machine's.
Round time is the wall time of one call on a rank (no compute between calls), over all ranks and rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wagma import GroupSchedule, WaitAvoidingGroupAllreduce  # noqa: E402
from wagma.testing import run_workers  # noqa: E402


def _worker(rank: int, world: int, group: int, rounds: int, numel: int, sync_period: int) -> list[tuple]:
    sched = GroupSchedule.create("auto", world, group)
    out = []
    x = torch.ones(numel)
    with WaitAvoidingGroupAllreduce(sched, x, sync_period=sync_period, timeout=datetime.timedelta(seconds=30)) as eng:
        for _ in range(rounds):
            t0 = time.perf_counter()
            res = eng(x)
            out.append((res.round, res.is_sync, time.perf_counter() - t0, res.activated_at, res.triggered_at))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--sync-period", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    per_rank = run_workers(
        _worker, args.world, args.group, args.rounds, args.numel, args.sync_period, timeout_s=600, collective_timeout_s=60
    )
    latencies, round_times, async_times = [], [], []
    for k in range(args.rounds):
        winners = [r for r in range(args.world) if per_rank[r][k][4] is not None]
        for r in range(args.world):
            round_times.append(per_rank[r][k][2])
            if not per_rank[r][k][1]:
                async_times.append(per_rank[r][k][2])
        if len(winners) == 1:
            t = per_rank[winners[0]][k][4]
            latencies += [per_rank[r][k][3] - t for r in range(args.world) if r != winners[0]]
    result = {
        "world_size": args.world,
        "group_size": args.group,
        "rounds": args.rounds,
        "numel": args.numel,
        "sync_period": args.sync_period,
        "median_activation_latency_ms": 1e3 * statistics.median(latencies) if latencies else None,
        "p90_activation_latency_ms": 1e3 * statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 10 else None,
        "median_round_ms": 1e3 * statistics.median(round_times),
        "median_async_round_ms": 1e3 * statistics.median(async_times),
        "machine": f"{platform.node()} {platform.machine()}, {__import__('os').cpu_count()} cores, torch {torch.__version__}",
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
