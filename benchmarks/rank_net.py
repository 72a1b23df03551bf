"""Does ``rank_net`` behave like the network it emulates? gloo transfers timed against the bandwidth model.

    python benchmarks/rank_net.py                          # P = 4 at 200mbit: allreduce 1 and 4 MB, a pair exchange
    python benchmarks/rank_net.py --world 8 --rate 1gbit --sizes-mb 1 16 --reps 5 --out /tmp/net.json
    python benchmarks/rank_net.py --loopback               # the same transfers through loopback, for contrast

Every rank runs in its own network namespace behind a link shaped to ``--rate``
(:class:`wagma.app.network.RankNetwork`, made by :func:`wagma.app.network.worker_setup` before the rank's process
group), and times, after a warm-up, ``--reps`` of each transfer (the median is kept; a barrier starts each):

- ``allreduce``: ``dist.all_reduce`` of a float32 tensor of the size on every rank; model: a ring allreduce moves
  2(P-1)/P x bytes through every rank's link in each direction, so ``2(P-1)/P x bytes / rate``;
- ``pair``: ranks 0 and 1 send each other the size at once (``irecv`` posted, then ``isend``), the others idle; on
  full-duplex links each direction carries the bytes once, ``bytes / rate``.

The ratio measured / model should be near 1: above by the protocol (TCP/IP headers, about 3 %, and gloo's own
messages), below by at most the shaper's bucket (:func:`wagma.app.network.tbf_burst`) per transfer. Prints one line
per transfer, with the CPU time the participating ranks spent in it (every thread; on the wire a rank waits
without it), and writes the records (``--out``, JSON) with the rate, the world and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks.machine import machine_info  # noqa: E402
from wagma.app.network import check_rank_net, network_job, parse_rate, rate_name, worker_setup  # noqa: E402
from wagma.testing import run_workers  # noqa: E402

__all__ = ["main", "model_s", "time_transfers"]


def model_s(kind: str, nbytes: int, world: int, bits_per_s: float) -> float:
    """The bandwidth model's seconds for a transfer (module docstring)."""
    if kind == "allreduce":
        return 2 * (world - 1) / world * nbytes * 8 / bits_per_s
    if kind == "pair":
        return nbytes * 8 / bits_per_s
    raise ValueError(f"kind: expected 'allreduce' or 'pair', found {kind!r}")


def _timed(rank: int, world: int, sizes: list[int], reps: int) -> dict[str, Any]:
    """On every rank: the median seconds of each (kind, size), and the namespace this rank is in."""
    import os

    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"netns": os.stat("/proc/thread-self/ns/net").st_ino, "times": {}, "cpu": {}}
    for nbytes in sizes:
        data = torch.ones(nbytes // 4)
        for kind in ("allreduce", "pair"):
            samples, cpu = [], []
            for rep in range(reps + 1):  # the first is a warm-up
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if kind == "allreduce":
                    dist.all_reduce(data)
                elif rank < 2:
                    back = torch.empty_like(data)
                    got = dist.irecv(back, 1 - rank)  # posted first: gloo sends once the peer's receive is posted
                    sent = dist.isend(data, 1 - rank)
                    assert sent is not None and got is not None
                    sent.wait()
                    got.wait()
                if rep:
                    samples.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)  # every thread of the rank, gloo's included
            out["times"][f"{kind}/{nbytes}"] = statistics.median(samples)
            out["cpu"][f"{kind}/{nbytes}"] = statistics.median(cpu)
    return out


def time_transfers(
    rate: str, world: int, sizes_mb: Sequence[float], reps: int, loopback: bool = False
) -> list[dict[str, Any]]:
    """One record per (kind, size): measured (the slowest rank's median; the pair's ranks for ``pair``), the
    participating ranks' mean CPU seconds per transfer (``cpu_s``), and the model at ``rate``. ``loopback``: the
    same transfers without rank networks, through loopback (``rank_net`` None in the records).

    Raises:
        RuntimeError: the host cannot make rank networks (:func:`wagma.app.network.check_rank_net`'s line).
    """
    problem = None if loopback else check_rank_net(rate, world, world)
    if problem is not None:
        raise RuntimeError(problem)
    bits = parse_rate(rate)
    assert bits is not None
    sizes = [int(mb * 1e6) // 4 * 4 for mb in sizes_mb]
    job = f"rank-net-check-{uuid.uuid4().hex[:8]}"
    with network_job(job, enabled=not loopback):
        outs = run_workers(
            _timed,
            world,
            sizes,
            reps,
            timeout_s=120 + 4 * reps * len(sizes) * world,
            collective_timeout_s=60.0,
            setup=None if loopback else worker_setup(rate, job),
        )
    namespaces = [o["netns"] for o in outs]
    if not loopback and len(set(namespaces)) != world:
        raise RuntimeError(f"the ranks did not run in {world} distinct network namespaces: {namespaces}")
    records = []
    for nbytes in sizes:
        for kind in ("allreduce", "pair"):
            ranks = outs if kind == "allreduce" else outs[:2]
            measured = max(o["times"][f"{kind}/{nbytes}"] for o in ranks)
            cpu = statistics.mean(o["cpu"][f"{kind}/{nbytes}"] for o in ranks)
            model = model_s(kind, nbytes, world, bits)
            records.append(
                {
                    "kind": kind,
                    "bytes": nbytes,
                    "world_size": world,
                    "rank_net": None if loopback else rate_name(rate),
                    "measured_s": measured,
                    "cpu_s": cpu,
                    "model_s": model,
                    "ratio": measured / model,
                    "reps": reps,
                }
            )
    return records


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description="gloo transfers over rank_net against the bandwidth model")
    p.add_argument("--world", type=int, default=4, help="ranks, each in its own network namespace (default 4)")
    p.add_argument("--rate", default="200mbit", help="every rank's link rate (default 200mbit)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0], help="transfer sizes in MB (1e6 bytes)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per transfer, after one warm-up")
    p.add_argument(
        "--loopback",
        action="store_true",
        help="the same transfers through loopback, without rank networks (ratios still to --rate)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    args = p.parse_args(argv)
    if args.world < 2 or args.reps < 1 or min(args.sizes_mb) <= 0:
        p.error(f"need --world >= 2, --reps >= 1, --sizes-mb > 0; got {args.world}, {args.reps}, {args.sizes_mb}")
    records = time_transfers(args.rate, args.world, args.sizes_mb, args.reps, args.loopback)
    for r in records:
        print(
            f"P={r['world_size']} {r['rank_net'] or 'loopback'} {r['kind']:<9} {r['bytes'] / 1e6:6.2f} MB: "
            f"{1e3 * r['measured_s']:8.1f} ms (CPU {1e3 * r['cpu_s']:6.1f} ms), model at {args.rate} "
            f"{1e3 * r['model_s']:8.1f} ms, ratio {r['ratio']:.2f}",
            flush=True,
        )
    if args.out is not None:
        command = "python benchmarks/rank_net.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"command": command, "machine": machine_info(ROOT), "records": records}, indent=1) + "\n"
        )
    return records


if __name__ == "__main__":
    main()
