"""Being launched: the process group from torchrun's environment, the device, and one Hydra run dir.

Process group (:func:`init_distributed`): an existing default group is used as is (tests, notebooks);
under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set) one is created from the
environment, with a timeout; a plain ``python train.py`` gets a one-rank gloo world. The device is
agreed on collectively: ``cpu``; ``cuda`` (every rank must have a GPU, or every rank raises); ``auto``
(CUDA when every rank has a GPU, else CPU everywhere). With a GPU in play the group is created as
``cpu:gloo,cuda:nccl``, so CPU tensors go through gloo and CUDA tensors through NCCL.

Elastic restarts (``torchrun --max-restarts N``): torchrun's agent keeps one c10d store for all attempts
of a job, so the keys a process group leaves there (its ranks' gloo addresses) would be found, stale, by
the next attempt's group. :func:`init_distributed` therefore prefixes the group's keys with the attempt
(``TORCHELASTIC_RESTART_COUNT``, see :func:`restart_count`); :func:`wagma.app.train.train` resumes a
restarted attempt from the newest complete checkpoint.

One run directory under torchrun: every rank runs Hydra itself, and Hydra's default run dir holds the
time of day, which can differ between ranks by a second. The ``wagma_now`` resolver (a drop-in for
Hydra's ``now``) formats one start time shared by all ranks and by every restart of the job: on one
node the start time of the torchrun agent (the parent of every rank, alive through restarts); across
nodes the first rank's clock, published in torchrun's c10d store under the job's id with a
first-writer-wins ``compare_set`` (the store lives as long as torchrun on the store's node).
``hydra.run.dir=DIR`` bypasses it. Only rank 0 writes Hydra's files: :func:`hydra_rank_overrides` adds
``hydra.output_subdir=null`` and ``hydra/job_logging=stdout`` on the other ranks, and
:func:`failures_reported_by_rank0` makes a failure all ranks share (a config Hydra cannot compose, a
config :func:`wagma.app.config.validate_config` rejects) reach the terminal once, from rank 0; any other
failure exits at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

import torch
import torch.distributed as dist

from wagma.app.procs import process_start_time
from wagma.checks import check_choice

__all__ = [
    "SHARED_FAILURE_EXIT_CODE",
    "DistContext",
    "env_rank",
    "env_world_size",
    "exit_at_once_on_failure",
    "failures_reported_by_rank0",
    "hydra_rank_overrides",
    "init_distributed",
    "meet",
    "register_resolvers",
    "release_stderr",
    "restart_count",
    "shared_start_time",
    "shutdown",
    "under_launcher",
]

#: Exit status of a failure every rank shares (a config :func:`wagma.app.config.validate_config` rejects).
SHARED_FAILURE_EXIT_CODE = 2

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_rank() -> int:
    """This process's rank: the default group's if one exists, else torchrun's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The world size: the default group's if one exists, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def under_launcher() -> bool:
    """Whether a launcher (torchrun, the elastic agent, srun with torchrun's variables) started this process as a rank.

    ``RANK`` or ``WORLD_SIZE`` in the environment; ``python train.py`` then trains in place instead of
    starting ranks of its own.
    """
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def _under_torchrun() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARS)


def restart_count() -> int:
    """How often torchrun has restarted this job's workers (``TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


#: Seconds every rank of an attempt gets to reach torchrun's store and arrive, before the process group is
#: created with its own (short) timeout: ranks start unevenly under load (imports, and store connects that
#: stall ~5 s on a busy machine), and a group created with a 5 s timeout fails on a rank that is 5 s late.
START_S = 60.0


def meet(store: dist.Store, rank: int, world_size: int, deadline_s: float) -> None:
    """Wait until every rank of ``world_size`` called this with the same ``store``; name the absent ones.

    Each rank sets ``meet/<rank>`` and waits for all the keys.

    Raises:
        TimeoutError: after ``deadline_s`` seconds, naming the ranks that did not arrive.
    """
    store.set(f"meet/{rank}", "1")
    keys = [f"meet/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=deadline_s))
    except RuntimeError as exc:  # torch's DistStoreError: the wait timed out
        missing = [r for r in range(world_size) if not store.check([f"meet/{r}"])]
        raise TimeoutError(
            f"rank(s) {missing} of {world_size} did not start within {deadline_s:.0f} s (seen from rank {rank}, "
            f"restart attempt {restart_count()}): they died, hang in start-up, or cannot reach the store at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        ) from exc


def _init_from_torchrun(backend: str, timeout: datetime.timedelta) -> None:
    """``init_process_group`` from torchrun's environment, its store keys kept apart per restart attempt.

    Under torchrun's agent store every rank first meets the others with :func:`meet` (within :data:`START_S`, or the
    group's timeout if longer), so the group's short timeout starts counting only once all ranks are there.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)  # rank 0 hosts a fresh store per attempt
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start_s = max(START_S, timeout.total_seconds())
    base = _torchrun_store(start_s)  # connects under the start deadline, not the group's timeout
    # The agent's store outlives an attempt; without the prefix a restarted group reads the gloo
    # addresses of the group before it and fails to connect ("connectFullMesh failed").
    store = dist.PrefixStore(f"wagma/attempt_{restart_count()}/", base)
    meet(store, rank, world_size, start_s)
    base.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank, world size, the agreed device, and who owns the process group."""

    rank: int
    world_size: int
    device: torch.device
    owns_process_group: bool


def init_distributed(device: str, timeout_s: float = 300.0) -> DistContext:
    """Join (or create) the default process group and agree on the device.

    Args:
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        timeout_s: timeout of a process group created here.

    Raises:
        ValueError: for another device string.
        RuntimeError: on every rank when ``device="cuda"`` and some rank has no GPU.
    """
    check_choice("device", device, ("auto", "cpu", "cuda"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    owns = not dist.is_initialized()
    if owns:
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "cpu:gloo,cuda:nccl" if device != "cpu" and has_gpu else "gloo"
        if has_gpu and device != "cpu":
            torch.cuda.set_device(local_rank)
        if _under_torchrun():
            _init_from_torchrun(backend, timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if device == "cpu":
        return DistContext(rank, world_size, torch.device("cpu"), owns)
    # Agree collectively, so that either every rank uses its GPU or none does.
    flag_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if has_gpu else 0], device=flag_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    all_have_gpu = bool(flag.item())
    if device == "cuda" and not all_have_gpu:
        raise RuntimeError(
            "device=cuda was requested but at least one rank has no CUDA GPU for its LOCAL_RANK; "
            "use device=auto or device=cpu, or launch no more ranks per node than GPUs"
        )
    if all_have_gpu:
        torch.cuda.set_device(local_rank)
        return DistContext(rank, world_size, torch.device("cuda", local_rank), owns)
    return DistContext(rank, world_size, torch.device("cpu"), owns)


def shutdown(ctx: DistContext) -> None:
    """Destroy the default process group if :func:`init_distributed` created it."""
    if ctx.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def _torchrun_store(timeout_s: float) -> dist.Store:
    """A client of the c10d store torchrun's agent hosts at ``MASTER_ADDR:MASTER_PORT``."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


_start_time: float | None = None


def shared_start_time(timeout_s: float = 60.0) -> float:
    """The job's start time (seconds since the epoch): the same on every rank and every restart of one torchrun job.

    On one node (``LOCAL_WORLD_SIZE == WORLD_SIZE``) it is the start time of the torchrun agent, the parent
    of every rank, which a restart keeps (a restart brings new ranks and store keys, not a new agent).
    Across nodes it is the first rank's clock, published in torchrun's store under ``TORCHELASTIC_RUN_ID``.
    Outside torchrun it is this process's first call's clock. Cached for the life of the process.
    """
    global _start_time
    if _start_time is None:
        now = time.time()
        if _under_torchrun():
            one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
            one_agent = one_node and "TORCHELASTIC_RUN_ID" in os.environ
            agent = process_start_time(os.getppid()) if one_agent else None
            if agent is not None:
                now = agent
            else:
                key = f"wagma/start_time/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
                now = float(_torchrun_store(timeout_s).compare_set(key, "", repr(now)).decode())
        _start_time = now
    return _start_time


def _format_start_time(pattern: str) -> str:
    return datetime.datetime.fromtimestamp(shared_start_time()).strftime(pattern)


def register_resolvers() -> None:
    """Register the ``wagma_now`` OmegaConf resolver (``${wagma_now:%H-%M-%S}``), once."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("wagma_now"):
        OmegaConf.register_new_resolver("wagma_now", _format_start_time, use_cache=True)


def hydra_rank_overrides(argv: Sequence[str], rank: int) -> list[str]:
    """Hydra overrides that stop a rank other than 0 from writing ``.hydra/`` and a log file.

    Keys the command line already sets are left alone.
    """
    if rank == 0:
        return []
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in argv}
    wanted = {"hydra.output_subdir": "hydra.output_subdir=null", "hydra/job_logging": "hydra/job_logging=stdout"}
    return [override for key, override in wanted.items() if key not in given]


_held: tuple[TextIO, io.StringIO] | None = None
_task_started = False  # set by release_stderr: Hydra composed the config and the task function runs


def _failure_key() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"wagma/failure_reported/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


@contextlib.contextmanager
def failures_reported_by_rank0(wait_s: float = 10.0) -> Iterator[None]:
    """Around the ``@hydra.main`` call: let a failure that every rank shares reach the terminal once.

    On ranks other than 0, stderr is held back until :func:`release_stderr` (call it first thing in the
    task function), so Hydra's report of a config it cannot compose (unknown option, bad override) is
    not printed once per rank. A shared failure is one of these two: the task function never ran
    (stderr still held: Hydra could not compose the config), or the exit status is
    :data:`SHARED_FAILURE_EXIT_CODE` (a config :func:`wagma.app.config.validate_config` rejects). On a shared
    failure under torchrun, rank 0 (which has printed its report by then) publishes that in torchrun's
    store and the other ranks wait for it, at most ``wait_s`` -- torchrun stops all workers when the first
    one exits, which could otherwise kill rank 0 before it printed. Rank 0 meets the same failure, so the
    wait ends when it reports; a rank that hears nothing in time prints what it held back. Any other
    failure (a peer that died or hung, a bug on one rank) is this rank's own to report: it exits at once,
    with no wait. ``HYDRA_FULL_ERROR=1`` disables the holding back.
    """
    global _held
    rank = env_rank()
    if rank != 0 and os.environ.get("HYDRA_FULL_ERROR") != "1":
        _held = (sys.stderr, io.StringIO())
        sys.stderr = _held[1]
    rank0_reported = False
    try:
        yield
    except SystemExit as exc:
        shared = _held is not None or (rank == 0 and not _task_started) or exc.code == SHARED_FAILURE_EXIT_CODE
        if exc.code not in (None, 0) and shared and _under_torchrun():
            rank0_reported = _signal_failure_reported() if rank == 0 else _wait_failure_reported(wait_s)
        raise
    finally:
        if _held is not None:
            real, buffer = _held
            sys.stderr = real
            _held = None
            if not rank0_reported:
                real.write(buffer.getvalue())


def _signal_failure_reported() -> bool:
    try:
        _torchrun_store(5.0).set(_failure_key(), "1")
    except Exception:  # noqa: BLE001 - exiting anyway; the others stop waiting after their timeout
        pass
    return True


def _wait_failure_reported(wait_s: float) -> bool:
    try:
        _torchrun_store(wait_s).wait([_failure_key()], datetime.timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - DistStoreError on time, or no store: rank 0 did not report
        return False
    return True


@contextlib.contextmanager
def exit_at_once_on_failure() -> Iterator[None]:
    """Around the entry point: after a failure has been reported, exit without the interpreter's teardown.

    A process group broken by a dead or frozen peer can hold the interpreter's exit for seconds (measured:
    about 7 s after a gloo timeout, in the destructors of torch's C++ objects). The error is printed and
    recorded by then, so a non-zero ``SystemExit`` flushes the streams and logs and ends the process with
    ``os._exit``; a successful run exits normally.
    """
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def release_stderr() -> None:
    """Restore stderr held by :func:`failures_reported_by_rank0`, replaying what was written meanwhile.

    Call it first thing in the task function: it also marks the config as composed, so a later failure
    is not taken for one that every rank shares.
    """
    global _held, _task_started
    _task_started = True
    if _held is not None:
        real, buffer = _held
        sys.stderr = real
        _held = None
        real.write(buffer.getvalue())
