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

With ``peer_stopped=True`` (wagma only) the round rank 0 leaves behind has not begun anywhere: the harness
stops rank 1 (SIGSTOP) before rank 0 triggers round 1, and resumes it two seconds later, once rank 0 has fallen
off the end (or, with ``leave="close"``, called ``close()`` at once after the trigger, before its thread could
begin the round: without the drain this variant fails). The promise tested: a round activated before a rank
stops is still run by it, with its last contribution, so rank 1 completes round 1 instead of failing on a peer
that left it.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_world(
    kind: str, world: int = 2, timeout_s: float = 60.0, peer_stopped: bool = False, leave: str = "exit"
) -> list[tuple[int, str]]:
    """Run the ranks as subprocesses; return each rank's (exit code, output)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    marks = tempfile.TemporaryDirectory(prefix="wagma-exit-")
    extra = [marks.name, leave] if peer_stopped else []
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(port), kind, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    if peer_stopped:
        try:
            _stop_and_resume(procs[1].pid, Path(marks.name), timeout_s)
        except BaseException:
            for p in procs:
                p.kill()
            raise
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    marks.cleanup()
    return out


def _wait_for(path: Path, deadline: float) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected {path.name} to appear, found none before the deadline")
        time.sleep(0.02)


def _stop_and_resume(pid: int, marks: Path, timeout_s: float) -> None:
    """Stop rank 1 once it finished round 0, let rank 0 trigger round 1 and leave, resume rank 1 2 s later."""
    deadline = time.monotonic() + timeout_s
    _wait_for(marks / "ready1", deadline)
    os.kill(pid, signal.SIGSTOP)
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 1 (pid {pid}) did not stop")
        time.sleep(0.01)
    (marks / "stopped1").touch()
    time.sleep(2.0)  # rank 0 triggers round 1 and is in its close() or its interpreter's exit by now
    os.kill(pid, signal.SIGCONT)
    (marks / "resumed1").touch()


def _main(rank: int, world: int, port: int, kind: str, marks: Path | None, leave: str) -> None:
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
    if marks is not None:
        _peer_stopped(rank, marks, avg, engine, w, leave)
        return
    if rank == 0:
        engine._maybe_trigger(1)  # round 1 starts for every rank's progress thread
    # Every rank is past round 0 and round 1 is under way: leave without close().
    store.set(f"leaving/{rank}", "1")
    store.wait([f"leaving/{r}" for r in range(world)])
    print(f"rank {rank} leaves without close()", flush=True)


def _peer_stopped(rank: int, marks: Path, avg: Any, engine: Any, w: Any, leave: str) -> None:
    """Rank 0 triggers round 1 while rank 1 is stopped and leaves (exit, or close() at once); rank 1, resumed,
    completes round 1."""
    deadline = time.monotonic() + 30.0
    if rank == 1:
        (marks / "ready1").touch()
        _wait_for(marks / "resumed1", deadline)  # stopped and resumed by the harness meanwhile
        avg.average_parameters([w])  # round 1: rank 0 triggered it and left
        print(f"rank 1 completed round 1, fresh contributions {avg.stats.fresh_contributions}", flush=True)
        avg.close()
        return
    _wait_for(marks / "stopped1", deadline)
    engine._maybe_trigger(1)  # round 1 is activated; no thread has begun it (rank 1 is stopped)
    if leave == "close":
        avg.close()  # at once: runs round 1 first, returns once rank 1 is back
    print(f"rank 0 leaves by {leave}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    marks = Path(args[4]) if len(args) > 4 else None
    _main(int(args[0]), int(args[1]), int(args[2]), args[3], marks, args[5] if len(args) > 5 else "exit")
