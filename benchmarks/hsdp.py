"""HSDP x WAGMA against FSDP2's own HSDP: step rate under a straggler, accuracy at equal samples, memory per rank.

    python benchmarks/hsdp.py                      # 4 replicas x 2 shards, 3 seeds, writes benchmarks/results/hsdp/
    python benchmarks/hsdp.py --quick              # 2 x 2, 1 seed, a smoke test

Every rank trains an MLP on its own shard of digits (the application's dataset, no download) with FSDP2 on a
``("replicate", "shard")`` CPU mesh (gloo). A step is emulated compute (a sleep of T) plus the real forward and
backward pass; each step one rank of the job, drawn with a seed shared by all ranks, sleeps another T (the regime
benchmark's ``random_k1``). Its replica's other ranks wait for it inside FSDP2's collectives, so a straggling rank
makes a straggling replica. Policies:

- ``hsdp``: FSDP2's native HSDP (``fully_shard`` over the 2-D mesh): gradients all-reduced across replicas every step;
- ``hsdp_wagma``: ``fully_shard`` over ``shard``, ``WagmaAverager(2, sync_period=10, world=(mesh, "replicate"))``;
- ``hsdp_eager``: ``fully_shard`` over ``shard``, ``FSDPPartialAllreduce(mode="solo", sync_period=10)``;
- ``hsdp_local``: ``fully_shard`` over ``shard`` and no averaging across replicas at all: the no-wait bound on the
  step rate (its accuracy is that of a model trained on 1/R of the data).

At the end the averaging policies average once over all replicas (``synchronize`` / ``flush``) and rank 0 evaluates
on the test split. Memory: peak RSS per rank while training a larger MLP for a few steps, plain DDP beside HSDP x
WAGMA (RSS after ``import torch`` subtracted). Ranks share this machine's cores, which a cluster's devices do not:
the step rate here is a sleep-dominated emulation (T >= 20 ms against a ~1 ms real step), as in benchmarks/regime.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wagma.testing import run_workers  # noqa: E402

POLICIES = ("hsdp", "hsdp_wagma", "hsdp_eager", "hsdp_local")
#: The memory benchmark: plain DDP, FSDP2 over the shard dimension alone (no averager), and with WAGMA's averager.
MEMORY_KINDS = ("ddp", "fsdp_shard_only", "hsdp_wagma")
TIMEOUT = datetime.timedelta(seconds=60)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _mesh(replicas: int, shards: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _train_worker(
    rank: int,
    world_size: int,
    policy: str,
    replicas: int,
    shards: int,
    steps: int,
    warmup: int,
    compute_s: float,
    seed: int,
    batch: int,
) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from wagma import FSDPPartialAllreduce, WagmaAverager
    from wagma.app.data import load_dataset

    torch.set_num_threads(1)
    mesh = _mesh(replicas, shards)
    data = load_dataset("digits", seed=seed)
    x, y = data.shard(rank, world_size)
    x = x.reshape(len(x), -1)
    torch.manual_seed(seed)  # one initial model everywhere
    model = nn.Sequential(nn.Linear(x.shape[1], 128), nn.ReLU(), nn.Linear(128, data.num_classes))
    fully_shard(model, mesh=mesh if policy == "hsdp" else mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averager = hook = None
    if policy == "hsdp_wagma":
        averager = WagmaAverager(
            2 if replicas % 2 == 0 else replicas,
            10,
            params=model.parameters(),
            world=(mesh, "replicate"),
            timeout=TIMEOUT,
        )
    elif policy == "hsdp_eager":
        hook = FSDPPartialAllreduce(model, world=(mesh, "replicate"), mode="solo", sync_period=10, timeout=TIMEOUT)
    draw = torch.Generator().manual_seed(10_000 + seed)  # the straggler of each step, the same on every rank
    order = torch.Generator().manual_seed(seed * 100 + rank)
    loss_fn = nn.CrossEntropyLoss()
    start = 0.0
    for step in range(steps + warmup):
        if step == warmup:
            start = time.perf_counter()
        straggler = int(torch.randint(world_size, (1,), generator=draw))
        time.sleep(compute_s * (2 if rank == straggler else 1))
        idx = torch.randint(len(x), (batch,), generator=order)
        loss = loss_fn(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(model.parameters())
    elapsed = time.perf_counter() - start
    if averager is not None:
        averager.synchronize(model.parameters())
        averager.close()
    if hook is not None:
        hook.flush(opt)
        hook.close()
    with torch.no_grad():
        test_x = data.x_test.reshape(len(data.x_test), -1)
        accuracy = float((model(test_x).argmax(dim=1) == data.y_test).float().mean())
    return {"step_s": elapsed / steps, "accuracy": accuracy}


def _memory_worker(rank: int, world_size: int, kind: str, replicas: int, shards: int, width: int) -> float:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wagma import WagmaAverager

    torch.set_num_threads(1)
    base = _rss_mb()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    averager = None
    if kind == "ddp":
        model = DDP(model)
    else:
        mesh = _mesh(replicas, shards)
        for layer in model:  # one layer unsharded at a time, as FSDP2 is meant to be used
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    if kind == "hsdp_wagma":
        averager = WagmaAverager(
            2 if replicas % 2 == 0 else replicas,
            10,
            params=model.parameters(),
            world=(mesh, "replicate"),
            timeout=TIMEOUT,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(3):
        loss = model(torch.randn(4, width)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(model.parameters())
    if averager is not None:
        averager.close()
    return _rss_mb() - base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--width", type=int, default=2048, help="hidden width of the memory benchmark's MLP")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--quick", action="store_true", help="2 x 2, at most 30 steps, 1 seed, width 512")
    p.add_argument("--memory-only", action="store_true", help="skip the training runs (writes hsdp_memory.json)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hsdp")
    a = p.parse_args()
    if a.quick:  # (--steps and --compute-ms still apply)
        a.replicas, a.shards, a.seeds, a.width = 2, 2, 1, 512
        a.steps = min(a.steps, 30)
    world = a.replicas * a.shards
    runs: list[dict[str, Any]] = []
    for seed in range(0 if a.memory_only else a.seeds):
        for policy in a.policies:
            out = run_workers(
                _train_worker,
                world,
                policy,
                a.replicas,
                a.shards,
                a.steps,
                a.warmup,
                a.compute_ms / 1e3,
                seed,
                a.batch,
                timeout_s=600,
                collective_timeout_s=60,
            )
            row = {
                "policy": policy,
                "seed": seed,
                "step_s": max(o["step_s"] for o in out),
                "accuracy": out[0]["accuracy"],
            }
            runs.append(row)
            print(
                f"seed {seed} {policy:11s} {1e3 * row['step_s']:7.1f} ms/step  accuracy {row['accuracy']:.4f}",
                flush=True,
            )
    memory = {}
    for kind in MEMORY_KINDS:
        mb = run_workers(
            _memory_worker, world, kind, a.replicas, a.shards, a.width, timeout_s=600, collective_timeout_s=60
        )
        memory[kind] = {"median_mb": statistics.median(mb), "max_mb": max(mb)}
        print(
            f"memory {kind:10s} peak RSS per rank above import: median {statistics.median(mb):.0f} MB, "
            f"max {max(mb):.0f} MB",
            flush=True,
        )
    params = 2 * a.width * a.width + 10 * a.width  # weights only
    summary = {}
    for policy in a.policies:
        rows = [r for r in runs if r["policy"] == policy]
        if not rows:
            continue
        summary[policy] = {
            "step_ms": 1e3 * statistics.median(r["step_s"] for r in rows),
            "accuracy": statistics.median(r["accuracy"] for r in rows),
        }
    if "hsdp" in summary:
        for s in summary.values():
            s["x_hsdp"] = summary["hsdp"]["step_ms"] / s["step_ms"]
            s["accuracy_vs_hsdp_points"] = 100 * (s["accuracy"] - summary["hsdp"]["accuracy"])
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "replicas": a.replicas,
        "shards": a.shards,
        "steps": a.steps,
        "compute_ms": a.compute_ms,
        "batch_per_rank": a.batch,
        "seeds": a.seeds,
        "runs": runs,
        "summary": summary,
        "memory": {"width": a.width, "weights": params, **memory},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    name = "hsdp_memory.json" if a.memory_only else "hsdp.json"
    (a.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print("| policy | ms/step (median) | x FSDP2 HSDP | test accuracy (median) | points vs HSDP |")
    print("|---|---:|---:|---:|---:|")
    for policy, s in summary.items():
        print(
            f"| {policy} | {s['step_ms']:.1f} | {s.get('x_hsdp', float('nan')):.2f} | {100 * s['accuracy']:.2f} % | "
            f"{s.get('accuracy_vs_hsdp_points', float('nan')):+.2f} |"
        )
    print(f"wrote {a.out / name}")


if __name__ == "__main__":
    main()
