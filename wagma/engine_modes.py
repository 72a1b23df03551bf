"""What a contribution is in each of the engine's two modes: the progress-thread side of :mod:`wagma.engine`.

:class:`ReplaceCore` (under :class:`wagma.engine.WaitAvoidingGroupAllreduce`): a call publishes a copy of its
tensor, immutable once published; the thread reads the newest copy for a round. :class:`AccumulateCore` (under
:class:`wagma.engine.AccumulatingGroupAllreduce`): a call adds its tensor into a pending sum, which the thread
swaps out for zeros, atomically, for a round, so every value goes out in exactly one round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from wagma.engine_core import CoreSetup, EngineCore, Outgoing, TakenContribution, is_sync

__all__ = ["AccumulateCore", "ReplaceCore"]


class ReplaceCore(EngineCore):
    """Replace mode: ``snapshot`` is the copy of the tensor this rank published last."""

    def __init__(self, setup: CoreSetup, *, keep_contributions: bool) -> None:
        self.being_read: torch.Tensor | None = None  # the snapshot the thread is copying right now
        # keep_contributions: snapshots a round result still hands to the main thread, by data pointer -> how many
        # results hold it. A held snapshot is never made a spare: nothing may overwrite it before it is released.
        self.keep_contributions = keep_contributions
        self.held_by_results: dict[int, int] = {}
        # wire_dtype (wagma.wire): the thread sends snapshot - reference, the reference being the mean of the last
        # sync round (the same on every rank: all take part, all receive the same sum), before the first one world
        # rank 0's initial tensor (broadcast at construction).
        self.reference: torch.Tensor | None = None
        super().__init__(setup)

    def first_exchange(self, initial: torch.Tensor) -> None:
        """With a wire dtype, the first reference: world rank 0's initial tensor, which every rank then holds bit
        for bit."""
        if self.wire is not None:
            self.reference = initial.detach().clone()
            if self.global_pg is not None:
                dist.broadcast(self.reference, group=self.global_pg, group_src=0)

    def publish(self, tensor: torch.Tensor, k: int, *, arrive: bool = True) -> None:
        """Make a copy of ``tensor`` this rank's snapshot, as of call ``k``. ``arrive=False`` (a snapshot published
        ahead of call ``k``) leaves ``arrived``, which the lead bound and blocking rounds wait on, as it is."""
        with self.cond:
            spare = self.take_spare()
        # Immutable once published: the thread reads it without a lock (a spare is read by no one).
        snap = tensor.detach().clone() if spare is None else spare.copy_(tensor.detach())
        event = self.record_event()
        with self.cond:
            old = self.snapshot
            self.snapshot, self.snapshot_version, self.snapshot_event = snap, k, event
            if old is not self.being_read:  # else the thread hands it back once its copy is done
                self.give_spare(old)
            if arrive:
                self.arrived = k
            self.cond.notify_all()

    def take_contribution(self, k: int, group: tuple[int, ...], activated_at: float) -> TakenContribution:
        """Lock held: the newest snapshot, marked as being read (and held for the result, with
        ``keep_contributions``), and a spare buffer for the round's sum."""
        send = self.snapshot
        self.being_read = send
        spare = self.take_spare()
        if self.keep_contributions:
            self.held_by_results[send.data_ptr()] = self.held_by_results.get(send.data_ptr(), 0) + 1
        return TakenContribution(
            k,
            is_sync(k, self.sync_period),
            group,
            activated_at,
            send,
            self.snapshot_version,
            self.snapshot_event,
            spare,
            send if self.keep_contributions else None,
        )

    def outgoing(self, taken: TakenContribution) -> Outgoing:
        """The snapshot may be contributed again next round, so the sum goes into another buffer: the delta on the
        wire dtype, the buffer shared memory writes, or a copy of the snapshot."""
        send, spare = taken.send, taken.spare
        if self.wire is not None:  # the delta is computed in `spare`, which then receives the sum
            spare = torch.empty_like(send) if spare is None else spare
            return Outgoing(sum=spare, wire=self.encode(send, spare))
        if self.shm:  # shared memory reads the snapshot and writes the sum elsewhere: no copy of ours
            return Outgoing(sum=torch.empty_like(send) if spare is None else spare, source=send)
        copy = send.clone() if spare is None else spare.copy_(send)
        self.done_reading(send)
        return Outgoing(sum=copy)

    def encode(self, send: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """The narrow tensor to send for the snapshot ``send`` (its delta from the reference, computed in
        ``scratch``); hands the snapshot back."""
        assert self.wire is not None
        if self.reference is None:
            wire = send.to(self.wire)
        else:
            wire = torch.sub(send, self.reference, out=scratch).to(self.wire)
        self.done_reading(send)
        return wire

    def decode(self, wire: torch.Tensor, out: torch.Tensor, size: int, sync: bool) -> None:
        """Widen the sum, add back the ``size`` contributions' reference, and after a sync round make its mean the
        new reference."""
        out.copy_(wire)
        if self.reference is not None:
            out.add_(self.reference, alpha=size)
        if sync:
            if self.reference is None:
                self.reference = torch.empty_like(out)
            torch.div(out, size, out=self.reference)

    def done_reading(self, snapshot: torch.Tensor) -> None:
        """The thread has read ``snapshot``; keep it for reuse if a newer one superseded it."""
        with self.cond:
            self.being_read = None
            if snapshot is not self.snapshot:  # superseded while it was being read
                self.give_spare(snapshot)

    def release_contribution(self, snapshot: torch.Tensor) -> None:
        """keep_contributions: a result that held ``snapshot`` was released; once no result holds it and it is
        neither the current snapshot nor being read, its memory is reused. Caller holds the lock."""
        ptr = snapshot.data_ptr()
        count = self.held_by_results.get(ptr, 0)
        if count <= 0:
            raise ValueError("release: this result's contribution is not held by the engine (released already?)")
        if count > 1:
            self.held_by_results[ptr] = count - 1
            return
        del self.held_by_results[ptr]
        if snapshot is not self.snapshot and snapshot is not self.being_read:
            self.give_spare(snapshot)

    def give_spare(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` for reuse unless a result still holds it; caller holds the lock."""
        if tensor.data_ptr() not in self.held_by_results:
            super().give_spare(tensor)

    def buffers_in_use(self) -> list[torch.Tensor | None]:
        return [self.snapshot, self.being_read, *self.spares, *(r.sum for r in self.results.values())]

    def is_in_use(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.held_by_results or super().is_in_use(tensor)

    def forget_buffers(self) -> None:
        self.held_by_results.clear()


class AccumulateCore(EngineCore):
    """Accumulate mode: ``snapshot`` is the pending contribution, the sum of what was added since the last
    exchange took it."""

    def __init__(self, setup: CoreSetup, *, error_feedback: bool) -> None:
        # Whether the pending contribution is the zeros an exchange (or take_pending()) left, with nothing added
        # since; then a submitted staging buffer replaces it instead of being added into it.
        self.pending_empty = False
        self.staging: torch.Tensor | None = None  # the buffer staging_buffer() hands out
        self.error_feedback = error_feedback
        super().__init__(setup)

    def publish(self, tensor: torch.Tensor, k: int) -> None:
        """Add ``tensor`` into the pending contribution, as call ``k`` (a staging buffer is taken over where it
        can be)."""
        staged = tensor is self.staging
        with self.cond:
            if self.snapshot_event is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(self.snapshot_event)
                self.snapshot.record_stream(stream)  # it may come from the thread's stream
            if staged and self.pending_empty:
                # The pending zeros become the next staging buffer and the staged values the pending
                # contribution: the same sum as adding, without a pass over either buffer.
                self.staging, self.snapshot = self.snapshot, tensor
            else:
                self.snapshot.add_(tensor.detach())
                if staged:
                    tensor.zero_()  # handed out again by staging_buffer(): zeros, as promised
            self.pending_empty = False
            self.snapshot_version = k
            self.snapshot_event = self.record_event()
            self.arrived = k
            self.cond.notify_all()

    def take_contribution(self, k: int, group: tuple[int, ...], activated_at: float) -> TakenContribution:
        """Lock held: the pending contribution, swapped out for zeros."""
        send, event = self.take_pending()
        return TakenContribution(
            k, is_sync(k, self.sync_period), group, activated_at, send, self.snapshot_version, event
        )

    def take_pending(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Take the pending contribution and leave zeros in its place; caller holds the lock."""
        out, event = self.snapshot, self.snapshot_event  # the consumer waits on `event` before reading
        spare = self.take_spare()
        self.snapshot = torch.zeros_like(out) if spare is None else spare.zero_()
        self.pending_empty = True
        self.snapshot_event = self.record_event()
        return out, event

    def outgoing(self, taken: TakenContribution) -> Outgoing:
        """The contribution taken receives the round's sum; on a wire dtype it goes out cast."""
        return Outgoing(sum=taken.send, wire=None if self.wire is None else self.encode(taken.send))

    def encode(self, send: torch.Tensor) -> torch.Tensor:
        """The contribution taken, cast to the wire dtype; with error feedback, what the cast rounds off stays
        pending, for a later round."""
        assert self.wire is not None
        wire = send.to(self.wire)
        if self.error_feedback:
            rounded_off = send.sub_(wire)  # (`send` becomes the round's sum once the exchange is done)
            with self.cond:
                if self.snapshot_event is not None:
                    torch.cuda.current_stream(self.device).wait_event(self.snapshot_event)
                self.snapshot.add_(rounded_off)
                self.pending_empty = False
                self.snapshot_event = self.record_event()
        return wire

    def decode(self, wire: torch.Tensor, out: torch.Tensor, size: int, sync: bool) -> None:
        """Widen the sum."""
        out.copy_(wire)

    def buffers_in_use(self) -> list[torch.Tensor | None]:
        return [self.snapshot, self.staging, *self.spares, *(r.sum for r in self.results.values())]
