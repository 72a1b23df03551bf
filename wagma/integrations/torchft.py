"""torchft: wagma's group model averaging across the live replica groups of a fault-tolerant job.

torchft decides who is in the job: a lighthouse forms a quorum of replica groups before each round, a replica
that dies drops out of the next quorum, one that (re)starts heals from a live peer's state before it takes part,
and a round any member failed is discarded by every member (``Manager.should_commit``). What is wagma's:

- **Groups over a changing membership.** Round ``k`` (the count of rounds the job has committed, which a healing
  replica takes from its peer) averages within the groups of ``GroupSchedule.for_members(n, group_size)`` at slot
  ``k``, where ``n`` is the size of the round's quorum and a replica's place in it is its participating rank. The
  group allreduces run on gloo groups of the quorum's members, built on the quorum's own store
  (:class:`ReplicaProcessGroup`), so a group round moves one model per member, not one per quorum member.
- **Sync rounds** (every ``sync_period``-th round) average over the whole quorum, whoever it holds.
- **A round is applied whole or not at all, on every replica.** Each replica keeps its parameters from before
  the round. If its own part of the round failed (a member of its group died mid-allreduce, a timeout), it
  reports the error to torchft, ``should_commit`` is false for it, and it restores those parameters: it never keeps
  half a round. Replicas whose groups did not hold the dead member commit their round as usual. A replica that
  discarded a round is one round behind the others, so at the next quorum it heals from a live peer (model,
  optimizer, averager state), like a replica that restarts. In a sync round every member's allreduce fails, so
  all of them discard it. Either way a survivor loses at most that one round, and goes on with the next quorum.

- **The data position.** The job's data is cut into shares (a period's batches each; the application maps share
  ``s`` to its samples). At each round every participant of the quorum is handed the next share by its rank, and
  the count of shares handed out is averager state, so a healing replica takes it from its peer. Guaranteed: no
  share is handed out twice, so no sample is trained on twice into the job's state. A fault loses shares: the two
  of the dead replica (the one it was training on, and the one the round it died in still handed it), the one of
  each replica that discarded that round, and the period a replica then healed over (:attr:`RoundReport.kept` says
  which); those samples are skipped, never repeated.

Use (one replica group per process here; see docs/integrations/torchft.md)::

    from torchft import Manager
    from wagma.integrations.torchft import ReplicaAverager, ReplicaProcessGroup

    pg = ReplicaProcessGroup(timeout=timedelta(seconds=10))
    averager = ReplicaAverager(model.parameters(), group_size=2, sync_period=4)
    manager = Manager(pg=pg, min_replica_size=2, use_async_quorum=False,
                      state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(),
                                          "wagma": averager.state_dict()},
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"]),
                                                 averager.load_state_dict(s["wagma"])), ...)
    averager.attach(manager, pg)
    averager.join()                           # round 0 at the start; a late or restarted replica heals here
    while True:
        batch = data[averager.share]          # share s: the samples of one period, the same s on no other replica
        loss(model(batch)).backward(); opt.step(); opt.zero_grad()
        averager.step()                       # a round every `period` steps: quorum, average, commit or roll back
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from wagma.checks import check_int
from wagma.integrations._common import require
from wagma.schedule import GroupSchedule

require("torchft", "torchft", "torchft")

from torchft import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo, create_store_client  # noqa: E402

__all__ = ["ReplicaAverager", "ReplicaProcessGroup", "RoundKind", "RoundReport"]

#: What a call of :meth:`ReplicaAverager.step` did: no round (between rounds), a group round, a sync round over
#: the whole quorum, or a round whose part on this replica failed, which it discarded.
RoundKind = Literal["none", "group", "sync", "discarded"]


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """What one call of :meth:`ReplicaAverager.step` or :meth:`ReplicaAverager.join` did.

    Attributes:
        kind: no round ("none": between rounds), a group round, a sync round, or a round this replica discarded.
        round: the round's number (0-based: the rounds the job had committed before it); ``None`` without a round.
        members: replicas in the round's quorum (0 without a round).
        trained_share: the share of the job's data this replica trained on in the period the round closed.
        kept: whether that training is in the job's state now: the round committed and this replica did not heal
            over it (a replica that heals takes a peer's state, and what it trained since its last round is gone).
        share: the share this replica trains on in the next period (``None`` while it is not participating).
    """

    kind: RoundKind
    round: int | None = None
    members: int = 0
    trained_share: int | None = None
    kept: bool = False
    share: int | None = None


class ReplicaProcessGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group across replica groups, which also builds wagma's groups in each quorum.

    Pass it to ``torchft.Manager(pg=...)`` and to :meth:`ReplicaAverager.attach`. Each time torchft configures it
    for a new quorum (a new store prefix), the groups of the previous quorum are dropped; a group of the current
    quorum is built the first time its members use it, on a prefix of the quorum's store named by its members.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._quorum_store: str | None = None
        self._member_groups: dict[tuple[int, ...], dist.ProcessGroupGloo] = {}

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """torchft's reconfiguration for a new quorum; the member groups of the old quorum are dropped."""
        self._member_groups.clear()
        self._quorum_store = None
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )
        self._quorum_store = store_addr

    def member_group(self, members: tuple[int, ...], rank: int) -> dist.ProcessGroupGloo:
        """The gloo group of ``members`` (participating ranks of the current quorum), as member ``rank``.

        Raises:
            RuntimeError: no quorum has been configured yet.
            ValueError: ``rank`` is not one of ``members``.
        """
        if self._quorum_store is None:
            raise RuntimeError("member_group() needs a quorum: call manager.start_quorum() first")
        if rank not in members:
            raise ValueError(f"rank: expected one of the group's members {members}, found {rank}")
        group = self._member_groups.get(members)
        if group is None:
            store = create_store_client(self._quorum_store, timeout=self._timeout)
            prefix = "wagma/" + "-".join(str(m) for m in members)
            group = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store), members.index(rank), len(members), self._timeout
            )
            self._member_groups[members] = group
        return group

    def member_group_allreduce(self, members: tuple[int, ...], rank: int, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ``members``; on failure abort and drop that group (peers waiting on it fail at once).

        Raises:
            Exception: whatever the allreduce raised (a peer's closed connection, a timeout).
        """
        group = self.member_group(members, rank)
        try:
            group.allreduce([tensor]).wait()  # type: ignore[attr-defined]  # not in torch's stubs
        except Exception:
            self._member_groups.pop(members, None)
            group.abort()
            raise


class ReplicaAverager:
    """Group model averaging across torchft's live replica groups, a round every ``period`` optimizer steps.

    Args:
        params: the parameters to average (bound by identity at construction; same order on every replica).
        group_size: replicas per group in group rounds (at least 2) (groups of the quorum's size ``n`` by
            ``GroupSchedule.for_members``); a quorum of at most ``group_size`` replicas averages as one group.
        sync_period: every ``sync_period``-th round averages over the whole quorum; 0: never.
        period: optimizer steps per round (1: a round after every step, as WAGMA; ``K``: K-step averaging).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, group_size: int = 2, sync_period: int = 4, period: int = 1):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("params: expected at least one tensor, found none")
        self.group_size = check_int("group_size", group_size, 2)
        self.sync_period = check_int("sync_period", sync_period, 0)
        self.period = check_int("period", period, 1)
        self.local_steps = 0
        self.committed = 0
        self.discarded = 0
        #: Shares of the job's data handed out so far; this replica's share for the current period.
        self.shares_assigned = 0
        self.share: int | None = None
        self._healed = False
        self.manager: Manager | None = None
        self.process_group: ReplicaProcessGroup | None = None
        self._schedules: dict[int, GroupSchedule] = {}  # by quorum size: built once, not every round

    def attach(self, manager: Manager, process_group: ReplicaProcessGroup) -> None:
        """Use ``manager`` for quorums and commits and ``process_group`` (the manager's ``pg``) for the groups."""
        if not isinstance(process_group, ReplicaProcessGroup):
            raise TypeError(
                f"process_group: expected the ReplicaProcessGroup given to Manager(pg=...), found "
                f"{type(process_group).__name__}"
            )
        self.manager, self.process_group = manager, process_group

    def is_sync_round(self, round: int) -> bool:
        """Whether round ``round`` (0-based) averages over the whole quorum."""
        return self.sync_period > 0 and (round + 1) % self.sync_period == 0

    def join(self) -> RoundReport:
        """Take part in the job's next round now, before training: call it once, after :meth:`attach`.

        At the start of a job every replica joins round 0 (its models are all the same). A replica that starts
        later, or again, heals from a live peer in the round's quorum and then runs the round like the others.
        Either way it leaves with its first :attr:`share` of the data.
        """
        return self._round()

    def step(self) -> RoundReport:
        """Count an optimizer step; every ``period`` steps run a round and report what it did.

        A round: start the quorum (a (re)joining or lagging replica heals here, before it takes part), average,
        then commit (keep the average, advance the round) or, if this replica's part of the round failed, restore
        the parameters from before it (it heals from a peer at the next quorum). Then the next period's share.
        """
        self.local_steps += 1
        if self.local_steps % self.period:
            self._manager()  # the same error before the first round as at it
            return RoundReport("none", trained_share=self.share, share=self.share)
        return self._round()

    def _manager(self) -> Manager:
        if self.manager is None or self.process_group is None:
            raise RuntimeError("step() needs a manager: call attach(manager, process_group) first")
        return self.manager

    def _round(self) -> RoundReport:
        manager = self._manager()
        trained, self._healed = self.share, False
        manager.start_quorum()
        healed = self._healed  # load_state_dict ran: this replica now holds a peer's state
        round, members = manager.current_step(), manager.num_participants()
        rank = manager.participating_rank() if manager.is_participating() else None
        flat = parameters_to_vector([p.detach() for p in self.params]).clone()
        kind: RoundKind = "sync" if self.is_sync_round(round) else "group"
        try:
            flat = self._average(flat, round, kind, members, rank)
        except Exception as exc:  # noqa: BLE001 -- a peer died mid-round or timed out: discard this round
            manager.report_error(exc)
        committed = manager.should_commit()
        if committed:
            with torch.no_grad():
                vector_to_parameters(flat, self.params)
            self.committed += 1
        else:
            self.discarded += 1
            kind = "discarded"
        # The next period's share: the same count on every member of the quorum, one share per participant.
        self.share = None if rank is None else self.shares_assigned + rank
        self.shares_assigned += members
        kept = committed and not healed and trained is not None
        return RoundReport(kind, round, members, trained, kept, self.share)

    def _average(self, flat: torch.Tensor, round: int, kind: RoundKind, members: int, rank: int | None) -> torch.Tensor:
        """Average ``flat`` in round ``round`` of a quorum of ``members``, as participating rank ``rank``."""
        manager = self.manager
        assert manager is not None and self.process_group is not None
        if kind == "sync" or members <= self.group_size:
            manager.allreduce(flat).wait()  # torchft's mean over the quorum's participants
            if manager.errored() is not None:
                # torchft keeps the error for should_commit; abort now, so that peers still waiting on this replica's
                # part of the ring fail at once instead of at their timeout (torchft builds a new group next quorum).
                self.process_group.abort()
            return flat
        if rank is None:
            return flat  # a replica still healing takes no part in group rounds
        schedule = self._schedules.get(members)
        if schedule is None:
            schedule = self._schedules[members] = GroupSchedule.for_members(members, self.group_size)
        group = schedule.group_of(rank, round)
        self.process_group.member_group_allreduce(group, rank, flat)
        return flat.div_(len(group))

    def state_dict(self) -> dict[str, Any]:
        """The averager's counters and the data position, for torchft's healing and for checkpoints."""
        return {name: getattr(self, name) for name in _STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's counters and data position (healing) or a checkpoint's."""
        missing = set(_STATE) - set(state)
        if missing:
            raise ValueError(f"state_dict: expected keys {', '.join(_STATE)}, missing {sorted(missing)}")
        for name in _STATE:
            setattr(self, name, check_int(f"state_dict[{name!r}]", state[name], 0))
        self._healed = True


#: What :meth:`ReplicaAverager.state_dict` holds (the current share is the next round's to hand out).
_STATE = ("local_steps", "committed", "discarded", "shares_assigned")
