"""A rank that leaves a collective in flight and exits without close().

Run as ``python exit_without_close.py RANK WORLD PORT KIND`` (KIND: ``wagma`` or ``partial``): every rank
builds a :class:`~wagma.WagmaAverager` or a :class:`~wagma.hooks.partial.PartialAllreduceState`, runs
round 0, rank 0 then triggers round 1 for everyone, and all ranks fall off the end of the script while
their progress threads exchange. :func:`run_world` starts the ranks as real interpreters, so the exit is a
real interpreter shutdown (the fork harness ends its children with ``os._exit``, which skips it).

The script destroys its own default process group at exit, after wagma's finalizers: torch 2.13 itself aborts
("terminate called without an active exception") in about 1 of 13 two-rank gloo runs that exit without
``destroy_process_group()``, wagma or not (3 of 40 runs of a bare allreduce here, 0 of 40 with it), and that
abort is not what this test is about.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_world(kind: str, world: int = 2, timeout_s: float = 60.0) -> list[tuple[int, str]]:
    """Run the ranks as subprocesses; return each rank's (exit code, output)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(port), kind],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def _main(rank: int, world: int, port: int, kind: str) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from wagma.averaging import WagmaAverager
    from wagma.hooks.partial import PartialAllreduceState

    timeout = datetime.timedelta(seconds=20)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    # Finalizers run at exit in reverse order of creation: this one after the engine's (created below).
    weakref.finalize(_main, dist.destroy_process_group)
    w = torch.ones(1_000_000) * rank  # big enough that the exchange is still running at exit
    if kind == "wagma":
        avg = WagmaAverager(2, 3, params=[w], timeout=10.0)
        avg.average_parameters([w])
        engine = avg._engines[0]
    elif kind == "partial":
        state = PartialAllreduceState([torch.nn.Parameter(w)], timeout=10.0)
        engine = state.engine
        engine(w)
    else:
        raise ValueError(f"kind: expected 'wagma' or 'partial', found {kind!r}")
    if rank == 0:
        engine._maybe_trigger(1)  # round 1 starts for every rank's progress thread
    # Every rank is past round 0 and round 1 is under way: leave without close().
    store.set(f"leaving/{rank}", "1")
    store.wait([f"leaving/{r}" for r in range(world)])
    print(f"rank {rank} leaves without close()", flush=True)


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
