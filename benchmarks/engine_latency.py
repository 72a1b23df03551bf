"""Activation latency and round time of the wait-avoiding group allreduce on this machine.

    python benchmarks/engine_latency.py [--world 4] [--group 2] [--rounds 500] [--numel 1024]
                                        [--device cpu|cuda] [--out FILE]

Each round, every rank that arrives before it has seen the round start triggers it and records when
(``triggered_at``; ranks arriving together may all trigger); every other rank's progress thread records
when it saw the activation (``activated_at``). Activation latency is ``activated_at`` minus the earliest
``triggered_at`` of the round, over all (round, non-triggering rank) pairs; the clocks are the same machine's.
Round time is the wall time of one call on a rank (no compute between calls), over all ranks and rounds.

``--device cuda`` gives rank r CUDA tensors on GPU ``r % device_count()`` (gloo, so one GPU can serve
the whole world):
the engine's progress thread then works on its own CUDA stream, and a round's time includes a
synchronisation of the caller's stream, so it counts until the result is usable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wagma import GroupSchedule, WaitAvoidingGroupAllreduce
from wagma.testing import rank_device, run_workers


def _worker(rank: int, world: int, group: int, rounds: int, numel: int, sync_period: int, device: str) -> list:
    sched = GroupSchedule.create("auto", world, group)
    out = []
    dev = rank_device(device, rank)
    x = torch.ones(numel, device=dev)
    timeout = datetime.timedelta(seconds=30)
    with WaitAvoidingGroupAllreduce(sched, x, sync_period=sync_period, timeout=timeout) as eng:
        for _ in range(rounds):
            t0 = time.perf_counter()
            res = eng(x)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            out.append((res.round, res.is_sync, time.perf_counter() - t0, res.activated_at, res.triggered_at))
    return out


def measure(
    world: int = 4, group: int = 2, rounds: int = 500, numel: int = 1024, sync_period: int = 10, device: str = "cpu"
) -> dict:
    """Run the engine on ``world`` forked gloo ranks and return latency and round-time statistics."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if rounds < 2 or numel < 1:
        raise ValueError(f"need rounds >= 2 and numel >= 1, got rounds={rounds}, numel={numel}")
    if device == "cuda":
        # Ask NVML, not the CUDA runtime: a parent that initialised CUDA cannot fork ranks that use it.
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is already initialised in this process, so forked ranks cannot use it: "
                "measure the engine before any other CUDA work"
            )
    per_rank = run_workers(
        _worker, world, group, rounds, numel, sync_period, device, timeout_s=600, collective_timeout_s=60
    )
    latencies, round_times, async_times = [], [], []
    for k in range(rounds):
        winners = [r for r in range(world) if per_rank[r][k][4] is not None]
        for r in range(world):
            round_times.append(per_rank[r][k][2])
            if not per_rank[r][k][1]:
                async_times.append(per_rank[r][k][2])
        if winners:
            t = min(per_rank[r][k][4] for r in winners)
            latencies += [per_rank[r][k][3] - t for r in range(world) if r not in winners]
    return {
        "world_size": world,
        "group_size": group,
        "rounds": rounds,
        "numel": numel,
        "sync_period": sync_period,
        "device": device,
        "median_activation_latency_ms": 1e3 * statistics.median(latencies) if latencies else None,
        "p90_activation_latency_ms": 1e3 * statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 10 else None,
        "median_round_ms": 1e3 * statistics.median(round_times),
        "median_async_round_ms": 1e3 * statistics.median(async_times) if async_times else None,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--sync-period", type=int, default=10)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.world, args.group, args.rounds, args.numel, args.sync_period, args.device)
    argv = sys.argv[1:] if argv is None else argv
    result["command"] = " ".join(["benchmarks/engine_latency.py", *argv])
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
