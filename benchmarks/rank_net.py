"""Does ``rank_net`` behave like the network it emulates? gloo transfers timed against the bandwidth model.

    python benchmarks/rank_net.py                          # P = 4 at 200mbit: allreduce 1 and 4 MB, a pair exchange
    python benchmarks/rank_net.py --world 8 --rate 1gbit --sizes-mb 1 16 --reps 5 --out /tmp/net.json
    python benchmarks/rank_net.py --loopback               # the same transfers through loopback, for contrast
    python benchmarks/rank_net.py --send-first             # pair and ring with the sends posted first

Every rank runs in its own network namespace behind a link shaped to ``--rate``
(:class:`wagma.app.network.RankNetwork`, made by :func:`wagma.app.network.worker_setup` before the rank's process
group), and times, after a warm-up, ``--reps`` of each transfer (the median is kept; a barrier starts each):

- ``allreduce``: ``dist.all_reduce`` of a float32 tensor of the size on every rank; model: a ring allreduce moves
  2(P-1)/P x bytes through every rank's link in each direction, so ``2(P-1)/P x bytes / rate``;
- ``group2``, ``group4``: the same within contiguous groups of S = 2 or 4 ranks, every group at once (WAGMA's
  group rounds); model ``2(S-1)/S x bytes / rate``; timed where S divides P and S < P;
- ``pair``: ranks 0 and 1 send each other the size at once (``irecv`` posted, then ``isend``), the others idle; on
  full-duplex links each direction carries the bytes once, ``bytes / rate``;
- ``ring``: every rank exchanges the size with both ring neighbours at once through the averagers' own
  point-to-point exchange (``wagma.averaging.gossip._Exchange``, receives posted first, as D-PSGD's round does);
  every link carries the bytes twice in each direction, ``2 x bytes / rate`` (P >= 3).

gloo starts a send once the peer's receive is posted; when both ranks of a pair post their sends first, a transfer
takes about twice the model (``--send-first`` shows it), which is why the averagers post their receives first.

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
from wagma.app.network import (  # noqa: E402
    check_rank_net,
    network_job,
    parse_rate,
    rate_burst,
    rate_name,
    worker_setup,
)
from wagma.testing import run_workers  # noqa: E402

__all__ = ["KINDS", "kinds_for", "main", "model_s", "time_transfers"]


KINDS = ("allreduce", "group2", "group4", "pair", "ring")
"""The transfers timed (module docstring); a group kind runs only where its size divides the world and is below it."""


def kinds_for(world: int) -> list[str]:
    """The kinds that :func:`time_transfers` times in a world of ``world`` ranks."""
    out = []
    for kind in KINDS:
        size = _group_size(kind)
        if (size is None or (world % size == 0 and size < world)) and (kind != "ring" or world >= 3):
            out.append(kind)
    return out


def _group_size(kind: str) -> int | None:
    return int(kind[5:]) if kind.startswith("group") else None


def model_s(kind: str, nbytes: int, world: int, bits_per_s: float) -> float:
    """The bandwidth model's seconds for a transfer (module docstring)."""
    if kind == "allreduce":
        return 2 * (world - 1) / world * nbytes * 8 / bits_per_s
    if (size := _group_size(kind)) is not None:
        return 2 * (size - 1) / size * nbytes * 8 / bits_per_s
    if kind == "pair":
        return nbytes * 8 / bits_per_s
    if kind == "ring":
        return 2 * nbytes * 8 / bits_per_s
    raise ValueError(f"kind: expected one of {', '.join(KINDS)}, found {kind!r}")


def _timed(rank: int, world: int, sizes: list[int], reps: int, send_first: bool) -> dict[str, Any]:
    """On every rank: the median seconds of each (kind, size), and the namespace this rank is in."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from wagma.averaging.gossip import _Exchange, ring_neighbours

    kinds = kinds_for(world)
    groups = {}
    for kind in kinds:
        if (size := _group_size(kind)) is not None:
            for first in range(0, world, size):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(first, first + size)))
                if first <= rank < first + size:
                    groups[kind] = group
    out: dict[str, Any] = {"netns": os.stat("/proc/thread-self/ns/net").st_ino, "times": {}, "cpu": {}}
    for nbytes in sizes:
        data = torch.ones(nbytes // 4)
        inbox = [torch.empty_like(data), torch.empty_like(data)]
        for kind in kinds:
            samples, cpu = [], []
            for rep in range(reps + 1):  # the first is a warm-up
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if kind == "allreduce":
                    dist.all_reduce(data)
                elif kind in groups:
                    dist.all_reduce(data, group=groups[kind])
                elif kind == "ring" and send_first:  # the order _Exchange refuses, so through dist directly
                    peers = ring_neighbours(rank, world)
                    works = [dist.isend(data, peer) for peer in peers]
                    works += [dist.irecv(inbox[j], peer) for j, peer in enumerate(peers)]
                    for work in works:
                        assert work is not None
                        work.wait()
                elif kind == "ring":  # the averagers' own exchange (D-PSGD's round without the mean)
                    exchange = _Exchange("rank_net", rep, dist.group.WORLD, datetime.timedelta(seconds=60))
                    peers = ring_neighbours(rank, world)
                    for j, peer in enumerate(peers):
                        exchange.recv(inbox[j], peer, tag=0)
                    for peer in peers:
                        exchange.send(data, peer, tag=0)
                    exchange.wait()
                elif rank < 2:
                    back = torch.empty_like(data)
                    if send_first:
                        sent = dist.isend(data, 1 - rank)
                        got = dist.irecv(back, 1 - rank)
                    else:  # the receive posted first, as the averagers do (module docstring)
                        got = dist.irecv(back, 1 - rank)
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
    rate: str, world: int, sizes_mb: Sequence[float], reps: int, loopback: bool = False, send_first: bool = False
) -> list[dict[str, Any]]:
    """One record per (kind, size): measured (the slowest rank's median; the pair's ranks for ``pair``), the
    participating ranks' mean CPU seconds per transfer (``cpu_s``), and the model at ``rate``. ``loopback``: the
    same transfers without rank networks, through loopback (``rank_net`` None in the records). ``send_first``: the
    point-to-point kinds post their sends before their receives (records carry ``send_first``).

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
            send_first,
            timeout_s=120 + 8 * reps * len(sizes) * world,
            collective_timeout_s=60.0,
            setup=None if loopback else worker_setup(rate, job),
        )
    namespaces = [o["netns"] for o in outs]
    if not loopback and len(set(namespaces)) != world:
        raise RuntimeError(f"the ranks did not run in {world} distinct network namespaces: {namespaces}")
    records = []
    for nbytes in sizes:
        for kind in kinds_for(world):
            ranks = outs[:2] if kind == "pair" else outs
            measured = max(o["times"][f"{kind}/{nbytes}"] for o in ranks)
            cpu = statistics.mean(o["cpu"][f"{kind}/{nbytes}"] for o in ranks)
            model = model_s(kind, nbytes, world, bits)
            records.append(
                {
                    "kind": kind,
                    "bytes": nbytes,
                    "world_size": world,
                    "rank_net": None if loopback else rate_name(rate),
                    "burst_bytes": None if loopback else rate_burst(rate),  # the shaper's bucket
                    "measured_s": measured,
                    "cpu_s": cpu,
                    "model_s": model,
                    "ratio": measured / model,
                    "reps": reps,
                    "send_first": send_first,
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
    p.add_argument(
        "--send-first",
        action="store_true",
        help="pair and ring: post the sends before the receives (the order the averagers must not use)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    args = p.parse_args(argv)
    if args.world < 2 or args.reps < 1 or min(args.sizes_mb) <= 0:
        p.error(f"need --world >= 2, --reps >= 1, --sizes-mb > 0; got {args.world}, {args.reps}, {args.sizes_mb}")
    records = time_transfers(args.rate, args.world, args.sizes_mb, args.reps, args.loopback, args.send_first)
    for r in records:
        kind = r["kind"] + (" (send first)" if r["send_first"] else "")
        print(
            f"P={r['world_size']} {r['rank_net'] or 'loopback'} {kind:<9} {r['bytes'] / 1e6:6.2f} MB: "
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
