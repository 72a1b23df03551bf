"""Sum-allreduce of CPU tensors through shared memory, for the ranks of one process group on one host.

gloo moves a CPU allreduce through TCP sockets even between processes of one machine: every byte is copied
into the kernel and out again, by worker threads that compete with training for the cores. Here the members
of a group share one memory segment instead, laid out as ``[slot 0 | ... | slot m-1 | out]`` with each part
``capacity`` elements long, and one call on member ``i`` of ``m`` is:

1. copy the tensor into slot ``i``;
2. barrier (every slot written);
3. sum chunk ``i`` (``numel / m`` elements) of every slot, in member order, into chunk ``i`` of ``out``;
4. barrier (every chunk summed);
5. copy ``out`` into the tensor (or into a separate output, leaving the input as it was).

The barriers are 1-element gloo allreduces on the group's own process group, so they carry its timeout and
its errors (a member that died or stopped shows up there, as it would in a gloo allreduce). No third barrier
is needed: a member writes its slot for the next call only after every member has read the slots of this
one (step 4), and writes ``out`` only after the next call's first barrier, which no member passes before it
has read ``out`` (step 5). Every member gets the same bits: each chunk is summed once, by one member.

The segment is a file in ``/dev/shm`` that the group's first member creates with its full size reserved
(``posix_fallocate``: a full ``/dev/shm`` is an error here, not a crash at the first write); every member maps
it, and after a barrier the creator unlinks it, so nothing is left behind however the processes end.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist

from wagma.checks import check_choice, check_int

__all__ = ["SHM_DIR", "SharedMemoryAllreduce", "check_transport", "TRANSPORTS"]

#: Where the segments are created (a tmpfs on Linux).
SHM_DIR = "/dev/shm"

#: ``"default"``: the process group's backend (gloo for CPU tensors, NCCL for CUDA ones); ``"shm"``: CPU tensors
#: of ranks on one host through shared memory (:class:`SharedMemoryAllreduce`).
TRANSPORTS = ("default", "shm")

_NAME_BYTES = 64


def check_transport(transport: object, device: torch.device | None = None) -> str:
    """Return ``transport`` if it is one of :data:`TRANSPORTS` and fits tensors on ``device``.

    Raises:
        ValueError: an unknown transport, or ``"shm"`` for tensors that are not on the CPU.
    """
    check_choice("transport", transport, TRANSPORTS)
    if transport == "shm" and device is not None and device.type != "cpu":
        raise ValueError(f"transport 'shm' reduces CPU tensors, found tensors on {device}: use 'default' (NCCL)")
    return str(transport)


def _host_identity() -> str:
    """This host's name and boot: processes with equal identities share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class SharedMemoryAllreduce:
    """Sum-allreduce of CPU tensors among the members of ``group`` (in place, or into an output), through one
    shared segment.

    Collective over ``group``: every member constructs it at the same point, as for any collective on that
    group. A tensor may have up to ``capacity`` elements of ``dtype``. Calls are collective too, in the same
    order on every member, from one thread at a time (the group's own collectives may not run concurrently
    with them).

    Args:
        group: a gloo process group (``None``: the default group) whose members all run on this host.
        capacity: the most elements a tensor passed to :meth:`all_reduce` may have.
        dtype: the tensors' dtype.

    Raises:
        ValueError: a member on another host, no ``/dev/shm``, a capacity below 1, or too little free space
            in ``/dev/shm`` for the segment (the message names how much is needed and how much is free).
    """

    def __init__(self, group: dist.ProcessGroup | None, capacity: int, dtype: torch.dtype = torch.float32) -> None:
        self.group = group
        self.capacity, self.dtype = check_int("capacity", capacity, minimum=1), dtype
        self.ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.size = len(self.ranks)
        self.index = dist.get_rank(group)
        self._flag = torch.zeros(1)
        self._buffer: torch.Tensor | None = None
        if self.size == 1:
            return
        hosts: list[str | None] = [None] * self.size
        dist.all_gather_object(hosts, _host_identity(), group=group)
        if len(set(hosts)) != 1:
            where = ", ".join(f"rank {r} on {h}" for r, h in zip(self.ranks, hosts))
            raise ValueError(f"transport 'shm' needs every member of a group on one host, found {where}")
        nbytes = (self.size + 1) * capacity * torch.empty((), dtype=dtype).element_size()
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)  # the segment's file name; all zeros: creation failed
        path, failure = "", None
        if self.index == 0:
            try:
                path = self._create(nbytes)
                encoded = os.path.basename(path).encode("ascii")
                name[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
            except ValueError as exc:
                failure = exc
        dist.broadcast(name, group_src=0, group=group)
        if failure is not None:
            raise failure
        if not name.any():
            raise ValueError(
                f"transport 'shm': rank {self.ranks[0]} could not create the group's shared segment "
                f"of {nbytes / 2**20:.1f} MiB in {SHM_DIR} (its error names why)"
            )
        if self.index != 0:
            path = os.path.join(SHM_DIR, bytes(name[name.ne(0)].tolist()).decode("ascii"))
        try:
            self._buffer = torch.from_file(path, shared=True, size=(self.size + 1) * capacity, dtype=dtype)
        finally:
            dist.barrier(group=group)  # every member has mapped it (or failed to): the name may go
            if self.index == 0:
                os.unlink(path)

    @staticmethod
    def _create(nbytes: int) -> str:
        if not os.path.isdir(SHM_DIR):
            raise ValueError(f"transport 'shm' needs {SHM_DIR} (Linux shared memory), which does not exist here")
        path = os.path.join(SHM_DIR, f"wagma-{os.getpid()}-{uuid.uuid4().hex[:16]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            stat = os.statvfs(SHM_DIR)
            raise ValueError(
                f"transport 'shm': the group's shared segment needs {nbytes / 2**20:.1f} MiB in {SHM_DIR}, which has "
                f"{stat.f_bavail * stat.f_frsize / 2**20:.1f} MiB free ({exc.strerror}); give it more room "
                f"(docker: --shm-size) or use transport 'default'"
            ) from exc
        os.close(fd)
        return path

    def _barrier(self) -> None:
        dist.all_reduce(self._flag, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``tensor`` (CPU, this object's dtype, any layout) over the group into ``out`` (default: ``tensor``
        itself, in place); return ``out``. With a separate ``out``, ``tensor`` is only read, and only before the
        first barrier: a caller that must keep its input intact spares a copy of its own.

        Raises:
            ValueError: a tensor (or ``out``) of another dtype, device or size, or longer than ``capacity``.
            RuntimeError: from a barrier: a member died, stopped, or did not call within the group's timeout.
        """
        dst = tensor if out is None else out
        for what, t in (("tensor", tensor), ("out", dst)):
            if t.device.type != "cpu" or t.dtype != self.dtype or t.numel() > self.capacity:
                raise ValueError(
                    f"all_reduce: expected {what} to be a CPU tensor of {self.dtype} with at most {self.capacity} "
                    f"elements, found {t.numel()} elements of {t.dtype} on {t.device}"
                )
        if dst.shape != tensor.shape:
            raise ValueError(f"all_reduce: expected out of shape {tuple(tensor.shape)}, found {tuple(dst.shape)}")
        if self._buffer is None:
            if self.size == 1:
                return dst if dst is tensor else dst.copy_(tensor)
            raise RuntimeError("this SharedMemoryAllreduce is closed")
        n, m, i, cap = tensor.numel(), self.size, self.index, self.capacity
        slots = self._buffer[: m * cap].view(m, cap)
        total = self._buffer[m * cap :]
        bounds = [n * j // m for j in range(m + 1)]
        lo, hi = bounds[i], bounds[i + 1]
        slots[i, :n].view(tensor.shape).copy_(tensor)
        self._barrier()
        if hi > lo:
            chunk = total[lo:hi]
            torch.add(slots[0, lo:hi], slots[1, lo:hi], out=chunk)
            for j in range(2, m):
                chunk.add_(slots[j, lo:hi])
        self._barrier()
        return dst.copy_(total[:n].view(dst.shape))

    def close(self) -> None:
        """Unmap the segment (idempotent); the memory is freed once every member has closed or exited."""
        self._buffer = None

    def __repr__(self) -> str:
        return f"SharedMemoryAllreduce(ranks={self.ranks}, capacity={self.capacity}, dtype={self.dtype})"
