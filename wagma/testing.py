"""Run a function on N gloo ranks in forked child processes.

This is the harness the test-suite (and the benchmarks) use to exercise collectives on one machine:
every call gets its own ``TCPStore``, a short collective timeout, and a worker's traceback comes back
to the caller tagged with its rank. Children are forked (not spawned): a 4-rank world starts in about
0.1 s instead of 4 s. Each child pins torch to one intra-op thread first, because a parent that already
ran multi-threaded torch work can otherwise make forked children hang, and leaves with ``os._exit``
after tearing its process group down, which avoids aborts in interpreter shutdown.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from wagma.checks import check_choice, check_int

__all__ = [
    "RankOutcome",
    "WorkerError",
    "error_messages",
    "rank_device",
    "run_torchrun",
    "run_workers",
    "run_workers_outcomes",
]


class WorkerError(RuntimeError):
    """A rank raised, died or did not finish; the message holds every failed rank's report."""


@dataclasses.dataclass
class RankOutcome:
    """What one rank of :func:`run_workers_outcomes` did.

    ``ok`` is True when the function returned; then ``value`` is what it returned. Otherwise
    ``error`` holds the formatted traceback (or a description of how the process ended) and
    ``exitcode`` the process's exit status (negative: killed by that signal).
    """

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


def error_messages(
    cases: dict[str, Callable[[], Any]], errors: tuple[type[BaseException], ...] = (ValueError,)
) -> dict[str, str | None]:
    """Call every case in turn: ``"ExcType: message"`` for one that raised one of ``errors``, else None.

    Any other exception propagates. Tests of argument validation use it inside a worker, where the
    arguments need a live process group, and check the messages in the parent.
    """
    out: dict[str, str | None] = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except errors as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def rank_device(kind: str, rank: int) -> Any:
    """The ``torch.device`` a test rank computes on: the CPU, or GPU ``rank % device_count()``.

    With ``kind="cuda"`` the GPU is made current, so several ranks can share one GPU over gloo
    (which takes CUDA tensors): one GPU can stand in for a multi-rank world. Call it in the worker.
    The forking parent must not have initialised CUDA itself (torch then refuses CUDA in the
    children): run such worlds from a fresh process, as ``tests/gpu_worlds.py`` does.
    """
    import torch  # this module imports torch lazily, for the store host's sake

    if check_choice("device kind", kind, ("cpu", "cuda")) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device kind 'cuda' needs a CUDA GPU, and torch.cuda.is_available() is False")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port_conn: Any,
    result_conn: Any,
    collective_timeout_s: float,
    backend: str,
    setup: Callable[[int, int], str | None] | None,
) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    code = 0
    try:
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store_host = setup(rank, world_size) if setup is not None else None
        port, prefix = port_conn.recv()
        client = dist.TCPStore(store_host or "127.0.0.1", port, world_size, False, timeout=timeout)
        store = dist.PrefixStore(prefix, client)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        # Gloo connects the default group inside init; a rank whose fn returns at once must not exit while a
        # slower rank is still connecting ("Connection closed by peer" there), so all wait until all are in.
        from wagma.groups import store_barrier  # after the fork, as torch above

        store_barrier(store, "initialized", world_size, timeout)
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = ("err", traceback.format_exc())
        code = 1
    try:
        result_conn.send_bytes(pickle.dumps(payload))
    except BaseException:  # noqa: BLE001 - e.g. an unpicklable return value
        result_conn.send_bytes(pickle.dumps(("err", "result could not be sent:\n" + traceback.format_exc())))
        code = 1
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - a broken group cannot be torn down cleanly
        pass
    os._exit(code)


_server: tuple[Any, int, Any] | None = None  # (host process, port, pipe kept open while it lives)
_world_ids = itertools.count()
_last_world_end = float("-inf")


def _host_store(conn: Any, parent_end: Any) -> None:
    import torch.distributed as dist

    parent_end.close()  # fork copied the parent's end: holding it here, the parent's death would never read as EOF
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    conn.send(server.port)
    conn.recv()  # blocks until the parent goes away (EOF) or says stop
    os._exit(0)


def _store_port() -> int:
    """Port of a TCPStore server shared by all worlds of this process, under distinct key prefixes.

    The server lives in a process of its own, started once, so no forked worker inherits a live server
    (its thread, its listening socket) from the parent.
    """
    global _server
    if _server is None or not _server[0].is_alive():
        ctx = mp.get_context("fork")
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_host_store, args=(child_end, parent_end), name="wagma-test-store", daemon=True)
        proc.start()
        _server = (proc, parent_end.recv(), parent_end)
    return _server[1]


def run_workers_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    collective_timeout_s: float = 10.0,
    backend: str = "gloo",
    setup: Callable[[int, int], str | None] | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; report every rank's outcome.

    Args:
        fn: called in each child after ``init_process_group``; its return value must pickle.
            Under fork it may be a closure or a local function.
        world_size: number of ranks (1 to 8 is sensible on a small machine).
        timeout_s: wall-clock limit for the whole world; ranks still running then are killed and
            reported as not finished.
        collective_timeout_s: timeout of the default process group and of the store.
        backend: ``"gloo"`` (CPU) unless the caller knows better.
        setup: optional ``f(rank, world_size)`` called first in each child, before it connects to the store: it
            may move the process (into a network namespace of its own, say) and returns the address at which the
            child then reaches the store (the store listens on every address of the caller's network namespace),
            or None for ``127.0.0.1``. A failure in it is the rank's failure.

    Returns:
        One :class:`RankOutcome` per rank, in rank order. Nothing is raised for a failed rank.
    """
    check_int("world_size", world_size, 1)
    # A world started right after the previous one ended often saw one store connect per process stall
    # for exactly 5 s (with a fresh interpreter per world it never happened). The cause is not pinned
    # down: not the server backend (libuv or classic), not DNS, not tcp_tw_reuse; spacing worlds at
    # least 1 s apart made the stall rare (about 1 world in 6 instead of 4 in 6 on a loaded machine).
    global _last_world_end
    time.sleep(max(0.0, _last_world_end + 1.0 - time.monotonic()))
    ranks = [
        _start_rank(fn, rank, world_size, args, collective_timeout_s, backend, setup) for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        port, prefix = _store_port(), f"world{next(_world_ids)}/"
        for rank in ranks:
            try:
                rank.port_conn.send((port, prefix))
            except OSError:  # (BrokenPipeError) the child has ended already, e.g. its setup failed: it reported
                pass
        outcomes = _collect(ranks, deadline, timeout_s)
    finally:
        _reap(ranks, deadline)
        _last_world_end = time.monotonic()
    for rank, out in zip(ranks, outcomes):
        if out.exitcode is None:
            out.exitcode = rank.proc.exitcode
    return outcomes


@dataclasses.dataclass
class _Rank:
    """A forked rank of :func:`run_workers_outcomes` and the parent's ends of its two pipes."""

    proc: Any  # a multiprocessing Process
    port_conn: Any  # sends the store's port and key prefix
    result_conn: Any  # receives the pickled outcome


def _start_rank(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    collective_timeout_s: float,
    backend: str,
    setup: Callable[[int, int], str | None] | None,
) -> _Rank:
    """Fork rank ``rank`` of the world, running :func:`_child`."""
    ctx = mp.get_context("fork")
    port_recv, port_send = ctx.Pipe(duplex=False)
    res_recv, res_send = ctx.Pipe(duplex=False)
    p = ctx.Process(
        target=_child,
        args=(fn, rank, world_size, args, port_recv, res_send, collective_timeout_s, backend, setup),
        name=f"wagma-test-rank{rank}",
        daemon=True,
    )
    p.start()
    res_send.close()
    return _Rank(p, port_send, res_recv)


def _collect(ranks: list[_Rank], deadline: float, timeout_s: float) -> list[RankOutcome]:
    """Every rank's outcome as its report arrives, until ``deadline``; a rank without one by then did not finish."""
    outcomes: dict[int, RankOutcome] = {}
    pending = set(range(len(ranks)))
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            if ranks[rank].result_conn.poll(0.01):
                outcomes[rank] = _read_outcome(rank, ranks[rank])
                pending.discard(rank)
    for rank in pending:
        outcomes[rank] = RankOutcome(rank, False, error=f"did not finish within {timeout_s:.0f} s (killed)")
    return [outcomes[rank] for rank in range(len(ranks))]


def _read_outcome(rank: int, started: _Rank) -> RankOutcome:
    """The outcome rank ``rank`` reported, or how its process ended when its pipe closed without a report."""
    try:
        kind, value = pickle.loads(started.result_conn.recv_bytes())
    except (EOFError, OSError):
        # The pipe closed without a report: the process died.
        started.proc.join(timeout=5.0)
        code = started.proc.exitcode
        return RankOutcome(rank, False, error=f"process ended without a result (exit code {code})", exitcode=code)
    return RankOutcome(rank, True, value=value) if kind == "ok" else RankOutcome(rank, False, error=value)


def _reap(ranks: list[_Rank], deadline: float) -> None:
    """Join every rank (killing one still alive, at the latest by ``deadline``) and close the parent's pipe ends."""
    for rank in ranks:
        p = rank.proc
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive() and p.pid is not None:  # a started process has a pid
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    for conn in [r.result_conn for r in ranks] + [r.port_conn for r in ranks]:
        conn.close()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    collective_timeout_s: float = 10.0,
    backend: str = "gloo",
    setup: Callable[[int, int], str | None] | None = None,
) -> list[Any]:
    """Like :func:`run_workers_outcomes`, but return the values and raise if any rank failed.

    Raises:
        WorkerError: naming every rank that raised, died or timed out, with its traceback.
    """
    outcomes = run_workers_outcomes(
        fn,
        world_size,
        *args,
        timeout_s=timeout_s,
        collective_timeout_s=collective_timeout_s,
        backend=backend,
        setup=setup,
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        report = "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in failed)
        raise WorkerError(f"{len(failed)} of {world_size} ranks failed:\n{report}")
    return [o.value for o in outcomes]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int,
    *args: str,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
    timeout_s: float = 150.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` on ``nproc`` local ranks (one intra-op thread each) and return
    the finished process; an exit status other than 0 fails with the tail of its output.

    The launching process's own rank variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) and the names in ``unset`` are removed from the environment; ``env`` adds variables.
    """
    environ = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *unset):
        environ.pop(var, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*command, str(script), *args], capture_output=True, text=True, timeout=timeout_s, env=environ, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
