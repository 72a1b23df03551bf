"""The shared base of wagma's model averagers: what is averaged, how it is flattened, what is counted.

Every averager in :mod:`wagma.averaging` (and the wait-avoiding ``WagmaAverager``) subclasses
:class:`AveragerBase`. The base owns the parts that do not depend on the averaging policy:

- binding the tensors to average by identity (:class:`~wagma.averaging.tensors.ParameterBinding`): the
  first call (or :meth:`AveragerBase.bind`) fixes the set and its order; later calls may list the same
  tensors in any order, another set raises ``ValueError``;
- packing them into :class:`~wagma.averaging.tensors.FlatBuffers` (one collective per buffer, not per tensor);
- the counters every averager reports in ``self.stats`` (reductions, bytes, waiting, staleness): an
  :class:`~wagma.averaging.stats.AveragerStats`, defined in :mod:`wagma.averaging.stats` and re-exported here;
- the blocking mean over a process group (:meth:`AveragerBase.allreduce_mean`), the step counter,
  ``state_dict``/``load_state_dict``, ``close`` and the final :meth:`AveragerBase.synchronize`.

A subclass implements :meth:`AveragerBase._average_step`, which runs whatever its policy schedules for
``self.step`` and says which kind of reduction (if any) it ran.
"""

from __future__ import annotations

import datetime
import time
import weakref
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from wagma.averaging.guards import (
    DoubleCommunicationGuard,
    order_ignored_by_caller,
    warn_at_caller,
)
from wagma.averaging.stats import AveragerStats, Reduction
from wagma.averaging.tensors import (
    BuffersLike,
    FlatBuffers,
    ParameterBinding,
    ParamsLike,
    collect_buffers,
    collect_named,
    collect_named_buffers,
    collect_parameters,
    local_tensor,
    reduced_parameters,
)
from wagma.checks import check_bool, check_int
from wagma.groups import (
    DEFAULT_TIMEOUT,
    as_timeout,
    destroy_groups,
    group_ranks,
    is_timeout,
    require_initialized,
)
from wagma.wire import WireDtype, as_wire_dtype, wire_dtype_for, wire_nbytes
from wagma.world import World, WorldLike, as_world

__all__ = [
    "AveragerBase",
    "AveragerStats",
    "OwnedResources",
    "FlatBuffers",
    "ParamsLike",
    "Reduction",
    "collect_buffers",
    "collect_named",
    "collect_parameters",
    "reduced_parameters",
]


class OwnedResources:
    """What an averager (or hook state) must release, held apart from it so that a finalizer can release it.

    ``closers`` (threads, engines) run first, newest first, then ``groups`` are destroyed. A finalizer
    must not reference the averager itself, or the averager could never be collected.
    """

    def __init__(self) -> None:
        self.closers: list[Any] = []  # objects with close(), e.g. progress engines
        self.groups: list[dist.ProcessGroup] = []

    def release(self) -> None:
        """Close every closer and destroy every group; idempotent."""
        closers, self.closers[:] = list(self.closers), []
        errors = []
        for closer in reversed(closers):
            try:
                closer.close()
            except Exception as exc:  # noqa: BLE001 - release the rest, then report the first error
                errors.append(exc)
        groups, self.groups[:] = list(self.groups), []
        destroy_groups(groups)
        if errors:
            raise errors[0]


class AveragerBase(ModelAverager):
    """Base of wagma's model averagers (a ``torch`` ``ModelAverager``).

    Protocol: call :meth:`average_parameters` once per training step (after ``optimizer.step()``, like
    torch's averagers). It collects the tensors to average, runs :meth:`_average_step` for the current
    ``self.step``, records the kind of reduction that ran in ``self.last_reduction`` (``None``,
    ``"local"`` or ``"global"``), then increments ``self.step``.

    Binding: the first call (for :class:`~wagma.averaging.WagmaAverager`, the constructor) binds the averager
    to the tensors it was given, by identity (:class:`~wagma.averaging.tensors.ParameterBinding`). Later
    calls may list the same tensors in any order (``optimizer.param_groups`` instead of
    ``model.parameters()``, a resumed run's optimizer): they are averaged in the bound order, so entry i of
    every flat buffer is always the same parameter. A call with another set raises ``ValueError`` naming the
    missing and the new tensors (by name when passed as ``named_parameters()`` or with ``param_names``);
    :meth:`bind` changes the set on purpose (on every rank).

    What is averaged: every parameter passed (whether or not it has a ``.grad``) and, when
    ``average_buffers`` is true, the floating-point tensors passed as ``buffers`` (e.g.
    ``module.buffers()``: BatchNorm running statistics; integer buffers are skipped). Buffers passed while
    ``average_buffers`` is false are ignored, so a training loop can always pass them and let the
    configuration decide. Optimizer state is never averaged.

    Process groups: with ``process_group=None`` the averager creates its own group over all ranks with
    ``timeout``, separate from the one DDP uses. Group creation is collective, so every rank of the
    default group constructs every averager, in the same order; subclasses create all the groups they
    need in their constructor (use :meth:`_new_group` so :meth:`close` releases them). A given
    ``process_group`` is used as is (its timeout is the one it was created with); a rank outside it
    counts steps and averages nothing.

    Guard rails (each a ``UserWarning``, once per averager, no communication): the first reduction looks
    for a ``DistributedDataParallel`` model that owns the averaged parameters, and while its comm hook
    still allreduces gradients (no hook, wagma's or torch's allreduce hooks, ``post_local_hook`` in its
    warm-up) a reduction warns about the double communication
    (:class:`~wagma.averaging.guards.DoubleCommunicationGuard`); an ``order="average_then_step"`` driven by
    torch's ``PostLocalSGDOptimizer``, which always steps first, warns at the first call.

    Lifetime: :meth:`close` (or leaving a ``with`` block) releases the groups (and a subclass's threads);
    an averager dropped or alive at interpreter exit without ``close()`` is released by a
    ``weakref.finalize`` finalizer, which holds the resources but not the averager, so reference cycles
    through the averager do not keep it from running.

    Worlds: ``world`` (``None``: the whole job; a process group; a ``(DeviceMesh, dim_name)`` pair, e.g. HSDP's
    ``"replicate"`` dimension) makes every reduction stay inside the calling rank's world; ranks and groups are
    then world ranks, and every rank of the job constructs its averager on its own world at the same time
    (:mod:`wagma.world`).

    Args:
        process_group: group of the global reductions; ``None`` creates one over all ranks of the world.
        average_buffers: also average the floating-point ``buffers`` passed to :meth:`average_parameters`.
        timeout: timeout of the groups this averager creates (``timedelta`` or seconds).
        world: the ranks to average over (see above).
        wire_dtype: the dtype reductions send and sum in (:mod:`wagma.wire`): ``None`` (the model's own),
            ``"bf16"``/``torch.bfloat16`` or ``"fp16"``/``torch.float16``; float32/float64 tensors then travel as
            their delta from the last global average (which every rank holds identically; before the first one,
            world rank 0's model, broadcast at the first reduction), divided by the group size, and are widened
            back. :meth:`synchronize` always sends the model's own dtype, so its replicas are exactly the mean.
            ``stats.bytes_sent`` counts the narrow bytes.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        average_buffers: bool = True,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
    ) -> None:
        check_bool("average_buffers", average_buffers)
        self.timeout = as_timeout(timeout)
        #: The dtype reductions send float32/float64 values in (``None``: their own; :mod:`wagma.wire`).
        self.wire_dtype: torch.dtype | None = as_wire_dtype(wire_dtype)
        # wire_dtype: per flat buffer, the mean of the last global reduction (identical on every rank), or None
        self._wire_refs: list[torch.Tensor | None] = []
        require_initialized(type(self).__name__)
        #: The ranks this averager averages over (:func:`wagma.world.as_world`); the whole job by default.
        self.world: World = as_world(world, self.timeout)
        if process_group is not None and world is not None:
            given = group_ranks(process_group) if isinstance(process_group, dist.ProcessGroup) else []
            if tuple(given) != self.world.ranks:
                raise ValueError(
                    f"process_group: expected a group over the world's ranks {list(self.world.ranks)}, found {given} "
                    "(pass world= alone to let the averager create its groups)"
                )
        self._resources = OwnedResources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        #: Groups this averager created (the same list its finalizer releases: extend it in place).
        self._owned_groups: list[dist.ProcessGroup] = self._resources.groups
        group = self._new_group(None) if process_group is None else process_group
        super().__init__(group)
        #: Whether this rank takes part in the averager's reductions.
        self.is_member: bool = isinstance(group, dist.ProcessGroup)
        #: Number of ranks in the global reductions (0 on a rank outside ``process_group``).
        self.world_size: int = group.size() if isinstance(group, dist.ProcessGroup) else 0
        self.average_buffers = average_buffers
        self.stats = AveragerStats()
        self.last_reduction: Reduction | None = None
        self._flat: FlatBuffers | None = None
        self._binding: ParameterBinding | None = None
        self._closed = False
        self._double_communication = DoubleCommunicationGuard(type(self).__name__)
        self._order_checked = False

    # -- the policy ------------------------------------------------------------------------------------

    @abstractmethod
    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        """Run what the policy schedules for ``self.step`` on ``tensors``; return the kind that ran.

        Called by :meth:`average_parameters` on member ranks, before ``self.step`` is incremented.
        Implementations reduce with :meth:`allreduce_mean` (or their own engine, using
        :meth:`flat_buffers` and ``self.stats``).
        """

    def average_parameters(self, params: ParamsLike, buffers: BuffersLike | None = None) -> Reduction | None:
        """Average what the policy schedules for this step, then advance the step counter.

        Args:
            params: ``model.parameters()``, a list of tensors, or ``optimizer.param_groups``.
            buffers: tensors averaged with the parameters when ``average_buffers`` is true
                (e.g. ``model.buffers()``; only floating-point ones are used).

        Returns:
            The kind of reduction this call ran (also in ``self.last_reduction``): ``None``, ``"local"``
            or ``"global"``.
        """
        self._check_open()
        if not self._order_checked:
            self._order_checked = True
            ignored = order_ignored_by_caller(getattr(self, "order", None), type(self).__name__)
            if ignored is not None:
                warn_at_caller(ignored)
        tensors = self.tensors_to_average(params, buffers)
        kind = self._average_step(tensors) if self.is_member else None
        if kind is not None:
            self._double_communication.check(tensors)
        self.last_reduction = kind
        self.step += 1
        return kind

    def synchronize(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Blocking mean over all ranks, for evaluation and checkpoints; counts as a global reduction.

        Does not advance ``self.step`` and does not change ``self.last_reduction``.

        Args:
            params: as in :meth:`average_parameters`.
            buffers: as in :meth:`average_parameters`.
        """
        self._check_open()
        if self.is_member:
            tensors = self.tensors_to_average(params, buffers, where="synchronize")
            self.allreduce_mean(tensors, self.process_group, "global", exact=True)

    # -- building blocks for subclasses ------------------------------------------------------------------

    def tensors_to_average(
        self, params: ParamsLike, buffers: BuffersLike | None = None, *, where: str = "average_parameters"
    ) -> list[torch.Tensor]:
        """The bound parameters, then (if ``average_buffers``) floating-point buffers, in the bound order; of a
        ``DTensor`` (an FSDP2 parameter) its local shard.

        The first call binds the averager to what it is given (see :meth:`bind`); later calls must pass the
        same tensor objects, in any order.

        Raises:
            ValueError: if the tensors are not the bound ones (the message names what differs).
        """
        tensors, names = self._collect(params, buffers)
        if self._binding is None:
            self._binding = ParameterBinding(tensors, names)
        arranged = self._binding.arrange(tensors, names, where=f"{type(self).__name__}.{where}")
        return [local_tensor(t) for t in arranged]  # bound by the DTensor, averaged as this rank's shard

    def bind(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Bind the averager to these tensors (and their order) from now on, replacing an earlier binding.

        Every rank must bind the same parameters at the same step (e.g. after ``add_param_group``).
        """
        self._check_open()
        self._binding = ParameterBinding(*self._collect(params, buffers))
        self._flat = None
        self._wire_refs = []

    def _collect(self, params: ParamsLike, buffers: BuffersLike | None) -> tuple[list[torch.Tensor], list[str | None]]:
        tensors, names = collect_named(params)
        if self.average_buffers and buffers is not None:
            more, more_names = collect_named_buffers(buffers, exclude=tensors)
            tensors, names = tensors + more, names + more_names
        return tensors, names

    def flat_buffers(self, tensors: Sequence[torch.Tensor]) -> FlatBuffers:
        """The averager's :class:`FlatBuffers` for ``tensors``, rebuilt only when the list changed."""
        self._flat = FlatBuffers.reuse_or_build(self._flat, tensors)
        return self._flat

    def allreduce_mean(
        self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, kind: Reduction, *, exact: bool = False
    ) -> None:
        """Replace ``tensors`` in place by their mean over ``group`` (blocking); count it as ``kind``.

        Each flat buffer is divided by the group size before the sum (as torch's averaging utility
        does), all buffers' allreduces are issued before the first wait. With a ``wire_dtype`` (and not
        ``exact``), a float32/float64 buffer is sent as ``(buffer - reference) / size`` in the narrow type, the
        reference being the result of the last ``"global"`` reduction (world rank 0's buffer before it), and
        widened back; a ``"global"`` reduction's result becomes the next reference.

        Raises:
            TimeoutError: if the collective timed out (a peer is slow, hung or gone); the group is then
                broken. Tensors flattened by :func:`~wagma.averaging.flatten_parameters` are reduced in their own
                memory, so after such a failure they hold a part-way result: restore them from a checkpoint.
        """
        flat = self.flat_buffers(tensors)
        buffers = flat.pack()
        if len(self._wire_refs) != len(buffers) and self.wire_dtype is not None and not exact:
            self._wire_refs = self._first_references(buffers)
        size = group.size()
        start = time.perf_counter()
        narrows = [wire_dtype_for(self.wire_dtype, buffer.dtype) for buffer in buffers]  # None: sent as it is
        works, narrowed, nbytes = [], [], 0
        for i, buffer in enumerate(buffers):
            narrow = None if exact else narrows[i]
            nbytes += wire_nbytes(buffer.numel(), buffer.dtype, narrow)
            if narrow is None:
                buffer.div_(size)
                works.append(dist.all_reduce(buffer, group=group, async_op=True))
                continue
            reference = self._wire_refs[i]
            delta = buffer if reference is None else torch.sub(buffer, reference)
            wire = delta.div_(size).to(narrow)
            works.append(dist.all_reduce(wire, group=group, async_op=True))
            narrowed.append((buffer, wire, reference))
        self.wait_collective(works, f"{kind} reduction", size)
        for buffer, wire, reference in narrowed:
            buffer.copy_(wire)
            if reference is not None:
                buffer.add_(reference)
        if kind == "global" and self.wire_dtype is not None:
            if len(self._wire_refs) != len(buffers):  # an exact reduction (synchronize) before any narrow one
                self._wire_refs = [None] * len(buffers)
            for i, buffer in enumerate(buffers):
                if narrows[i] is not None:
                    reference = self._wire_refs[i]
                    self._wire_refs[i] = buffer.clone() if reference is None else reference.copy_(buffer)
        self.stats.record_reduction(kind, nbytes, time.perf_counter() - start)
        flat.unpack()

    def _first_references(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """wire_dtype: world rank 0's buffers, broadcast in full precision over the averager's group, as the
        references of the first narrow reductions (every rank reaches its first reduction at the same step)."""
        references: list[torch.Tensor | None] = []
        works = []
        for buffer in buffers:
            if wire_dtype_for(self.wire_dtype, buffer.dtype) is None:
                references.append(None)
                continue
            reference = buffer.clone()
            works.append(dist.broadcast(reference, group=self.process_group, group_src=0, async_op=True))
            references.append(reference)
        self.wait_collective(works, "broadcast of the wire's first reference", self.world_size)
        return references

    def wait_collective(self, works: Iterable[Any], what: str, size: int) -> None:
        """Wait for the collectives ``works`` (bounded by their group's timeout); name ``what`` on failure.

        Raises:
            TimeoutError: if one timed out (a peer is slow, hung or gone), naming ``what``, the step and ``size``.
            RuntimeError: if one failed otherwise (e.g. a peer's connection closed), with the same names.
        """
        try:
            for work in works:
                work.wait()
        except RuntimeError as err:
            where = f"{type(self).__name__}: {what} at step {self.step} over {size} ranks"
            if is_timeout(err):
                raise TimeoutError(
                    f"{where} did not finish within the group's timeout; a peer is slow, hung or gone ({err})"
                ) from err
            raise RuntimeError(f"{where} failed; a peer is gone or its connection broke ({err})") from err

    def _new_world_group(self) -> dist.ProcessGroup:
        """:meth:`_new_group` over the whole world: this rank's group, never ``None``."""
        group = self.world.new_world_group(self.timeout)
        self._owned_groups.append(group)
        return group

    def _new_group(self, ranks: Sequence[int] | None) -> dist.ProcessGroup | None:
        """Create a group over ``ranks`` (world ranks; ``None``: the whole world) with this averager's timeout, in
        every world of the family; :meth:`close` destroys this rank's.

        Collective over the job: call it from the constructor, on every rank, in the same order.
        """
        group = self.world.new_group(ranks, self.timeout)
        if isinstance(group, dist.ProcessGroup):
            self._owned_groups.append(group)
        return group

    # -- state and lifetime --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The averager's resumable state: ``{"step": int, "stats": dict}``; subclasses add keys. With a
        ``wire_dtype``, also ``"wire_references"``: the references the next narrow reductions send deltas from."""
        state: dict[str, Any] = {"step": self.step, "stats": self.stats.as_dict()}
        if self.wire_dtype is not None:
            state["wire_references"] = [None if t is None else t.clone() for t in self._wire_refs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on a freshly built averager of the same config).

        Raises:
            ValueError: if a key is missing.
        """
        missing = {"step", "stats"} - set(state_dict)
        if missing:
            raise ValueError(
                f"state_dict: expected the keys {sorted(self.state_dict())}, found {sorted(state_dict)} "
                f"(missing {sorted(missing)})"
            )
        self.step = check_int("state_dict['step']", state_dict["step"], 0)
        self.stats = AveragerStats.from_dict(state_dict["stats"])
        references = state_dict.get("wire_references")
        self._wire_refs = (
            []
            if references is None or self.wire_dtype is None
            else [None if t is None else t.clone() for t in references]
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Release the process groups this averager created; idempotent. Later calls raise ``RuntimeError``."""
        if self._closed:
            return
        self._closed = True
        self._flat = None
        self._finalizer()

    def __enter__(self) -> AveragerBase:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed: build a new averager to keep averaging")
