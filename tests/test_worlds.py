"""Worlds: averagers, engines and hooks over a process group or a mesh dimension instead of the whole job."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wagma import GroupSchedule, WaitAvoidingGroupAllreduce
from wagma.averaging import HierarchicalAverager, PeriodicAverager, WagmaAverager
from wagma.testing import rank_device, run_workers, run_workers_outcomes
from wagma.world import World, as_world

TIMEOUT = datetime.timedelta(seconds=20)


def _mesh(shape=(2, 2)):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _tagged(rank: int) -> nn.Module:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(float(rank + 1) * (i + 1))
    return model


def _values(model: nn.Module) -> list[float]:
    """Each parameter's value divided by its index + 1 (the models above hold one value per tensor)."""
    return [float(p.detach().flatten()[0]) / (i + 1) for i, p in enumerate(model.parameters())]


def _family_worker(rank, world_size):
    mesh = _mesh()
    rep, shard = as_world((mesh, "replicate")), as_world((mesh, "shard"))
    # every rank passes the group of its own world; the family is read from the store
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    exchanged = as_world(groups[rank // 2])
    import pickle

    copy = pickle.loads(pickle.dumps(rep))  # a state that holds a world pickles: without the group
    assert copy.family == rep.family and copy.rank == rep.rank and copy.group is None and rep.group is not None
    return (
        rep.family,
        rep.ranks,
        rep.rank,
        shard.family,
        exchanged.family,
        exchanged.rank,
        rep.describe(1),
        as_world(None).whole_job,
        as_world(None).key,
        rep.key != as_world((mesh, "replicate")).key,
    )


def test_a_mesh_dimension_and_exchanged_groups_name_the_same_families_on_every_rank():
    out = run_workers(_family_worker, 4, collective_timeout_s=20)
    for rank, (rep, mine, wrank, shard, exchanged, xrank, described, whole, key, differ) in enumerate(out):
        assert rep == ((0, 2), (1, 3)) and shard == ((0, 1), (2, 3))  # mesh [[0, 1], [2, 3]]
        assert mine == (rank % 2, rank % 2 + 2) and wrank == rank // 2
        assert exchanged == ((0, 1), (2, 3)) and xrank == rank % 2
        assert described == f"rank {mine[1]} (world rank 1)"
        assert whole and key == "" and not differ  # the same world has the same key: its store namespace


def _bad_family_worker(rank, world_size, layout):
    groups = {"overlap": [[0, 1], [1, 2], [2, 3]], "sizes": [[0], [1, 2, 3]]}[layout]
    made = [dist.new_group(g) for g in groups]
    mine = next(pg for g, pg in zip(groups, made) if rank in g)  # rank 1 passes [0, 1], rank 2 passes [1, 2]
    with pytest.raises(ValueError) as err:
        as_world(mine)
    return str(err.value)


@pytest.mark.parametrize(
    "layout,said",
    [
        ("overlap", "expected disjoint worlds, found rank 1 in [0, 1] and [1, 2]"),
        ("sizes", "expected worlds of one size"),
    ],
)
def test_worlds_that_overlap_or_differ_in_size_are_refused_naming_them(layout, said):
    for message in run_workers(_bad_family_worker, 4, layout, collective_timeout_s=20):
        assert said in message


def _mesh_errors_worker(rank, world_size):
    with pytest.raises(ValueError, match="expected None .* found int"):
        as_world(3)
    mesh = _mesh()
    with pytest.raises(ValueError, match=r"the mesh has the dimensions \('replicate', 'shard'\), found 'data'"):
        as_world((mesh, "data"))
    return True


def test_an_unknown_mesh_dimension_or_another_kind_of_world_is_refused_saying_what_was_expected():
    assert all(run_workers(_mesh_errors_worker, 4, collective_timeout_s=20))


def _periodic_worker(rank, world_size):
    mesh = _mesh()
    model = _tagged(rank)
    with PeriodicAverager(1, world=(mesh, "replicate"), timeout=TIMEOUT) as avg:
        kind = avg.average_parameters(model.parameters())
        size = avg.world_size
    return kind, size, _values(model)


def test_periodic_averaging_on_the_replicate_dimension_means_each_replica_set_alone():
    for rank, (kind, size, values) in enumerate(run_workers(_periodic_worker, 4, collective_timeout_s=20)):
        world = (rank % 2, rank % 2 + 2)  # ranks of one shard index: values r + 1
        expected = sum(r + 1 for r in world) / 2
        assert kind == "global" and size == 2
        assert values == pytest.approx([expected, expected])


def _wagma_round0_worker(rank, world_size):
    # two worlds of 4 in a job of 8: worlds {0, 2, 4, 6} and {1, 3, 5, 7}, groups of 2 inside each
    groups = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]
    model = _tagged(rank)
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=0, world=groups[rank % 2], timeout=TIMEOUT) as avg:
        kind = avg.average_parameters(model.parameters())
        group = [avg.world.global_rank(r) for r in avg.schedule.group_of(avg.world.rank, 0)]
        worlds = avg.world.family
    return kind, group, worlds, _values(model)


@pytest.mark.slow  # 8 ranks
def test_wagma_on_two_worlds_mixes_each_rank_with_its_group_inside_its_world():
    out = run_workers(_wagma_round0_worker, 8, collective_timeout_s=30, timeout_s=120)
    for rank, (kind, group, worlds, values) in enumerate(out):
        assert worlds == ((0, 2, 4, 6), (1, 3, 5, 7))
        assert kind == "local" and rank in group and len(group) == 2
        assert all(r % 2 == rank % 2 for r in group), f"rank {rank}'s group {group} left its world"
        (partner,) = [j for j in group if j != rank]
        expected = (2 * (rank + 1) + (partner + 1)) / 3  # the (S + 1)-mix: own model twice, the partner's once
        assert values == pytest.approx([expected, expected])


def _independent_worker(rank, world_size, late_s):
    mesh = _mesh()
    model = _tagged(rank)
    times = []
    with WagmaAverager(2, 0, params=model.parameters(), world=(mesh, "replicate"), timeout=TIMEOUT) as avg:
        if rank in (1, 3):
            time.sleep(late_s)  # the world of shard index 1 starts late
        start = time.monotonic()
        for _ in range(5):
            avg.average_parameters(model.parameters())  # sync_period 0: a blocking world mean every call
            times.append(time.monotonic())
        first = times[0] - start
    return first, _values(model)


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_two_averagers_on_disjoint_worlds_run_side_by_side_each_waiting_for_its_own_world_only():
    late_s = 3.0
    out = run_workers(_independent_worker, 4, late_s, collective_timeout_s=20, timeout_s=90)
    for rank, (first, values) in enumerate(out):
        world = (rank % 2, rank % 2 + 2)
        expected = sum(r + 1 for r in world) / 2
        assert values == pytest.approx([expected, expected]), rank  # the mean of its world, never the job's
        assert first < late_s / 2, f"rank {rank} waited {first:.2f} s: for the other world's late ranks?"


def _engine_worker(rank, world_size, stall):
    mesh = _mesh()
    world = as_world((mesh, "replicate"))
    schedule = GroupSchedule.butterfly(2, 2)
    x = torch.full((4,), float(rank + 1))
    engine = WaitAvoidingGroupAllreduce(
        schedule, x, sync_period=3, max_lead=0, timeout=datetime.timedelta(seconds=3), world=world
    )
    sums = []
    try:
        for k in range(6):
            if stall and rank == 3 and k == 2:
                time.sleep(7)  # hung past its world's timeout (3 s)
                return "stalled"
            res = engine(x)
            sums.append(float(res.sum[0]))
    except (RuntimeError, TimeoutError) as err:
        return f"error: {err}"
    finally:
        engine.close()
    return sums


@pytest.mark.slow  # a real fault: a rank hangs past the timeout
def test_an_engine_on_a_world_sums_its_world_and_names_a_missing_rank_by_its_job_rank():
    out = run_workers_outcomes(_engine_worker, 4, True, collective_timeout_s=20, timeout_s=90)
    assert all(o.ok for o in out), [o.error for o in out if not o.ok]
    for rank in (0, 2):  # the other world: every round complete, its sum 1 + 3
        assert out[rank].value == [4.0] * 6
    said = out[1].value
    assert said.startswith("error:") and "rank(s) [3] (world rank(s) [1])" in said, said
    assert "round 2" in said, said


def _hierarchical_worker(rank, world_size):
    # 8 ranks as a 2 x 4 mesh: replicate worlds {0, 4}, {1, 5}, ...; shard worlds {0..3}, {4..7}; local blocks of 2
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = _tagged(rank)
    with HierarchicalAverager(2, 1, 2, world=(mesh, "shard"), timeout=TIMEOUT) as avg:
        blocks = avg.local_blocks
        kinds = [avg.average_parameters(model.parameters()) for _ in range(1)]
    return blocks, kinds, _values(model)


@pytest.mark.slow  # 8 ranks
def test_hierarchical_local_blocks_are_cut_from_the_world():
    out = run_workers(_hierarchical_worker, 8, collective_timeout_s=30, timeout_s=120)
    for rank, (blocks, kinds, values) in enumerate(out):
        base = rank // 4 * 4
        assert blocks == [[base, base + 1], [base + 2, base + 3]]
        assert kinds == ["global"]  # step 0: a global mean of the world
        expected = sum(r + 1 for r in range(base, base + 4)) / 4
        assert values == pytest.approx([expected, expected])


def test_world_is_exported():
    import wagma

    assert wagma.World is World and wagma.as_world is as_world


def _partial_hook_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wagma import PartialAllreduceState, partial_allreduce_hook

    mesh = _mesh()
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1, bias=False), process_group=mesh.get_group("replicate"))
    # sync_period 0: every round is a blocking mean of the world's fresh gradients (the warm-up's too)
    state = PartialAllreduceState(model.parameters(), sync_period=0, world=(mesh, "replicate"), timeout=TIMEOUT)
    model.register_comm_hook(state, partial_allreduce_hook)
    grads = []
    for _ in range(4):
        model.zero_grad()
        model(torch.full((1, 3), float(rank + 1))).sum().backward()  # gradient: (r + 1) in every entry
        grads.append(float(model.module.weight.grad[0, 0]))
    state.close()
    return grads


def test_the_partial_hook_on_a_world_reduces_that_worlds_gradients_only():
    for rank, grads in enumerate(run_workers(_partial_hook_worker, 4, collective_timeout_s=20, timeout_s=90)):
        expected = sum(r + 1 for r in (rank % 2, rank % 2 + 2)) / 2
        assert grads == pytest.approx([expected] * 4), rank


def _sgp_worker(rank, world_size):
    from wagma.averaging import SGPAverager

    mesh = _mesh()
    model = _tagged(rank)
    with SGPAverager(world=(mesh, "replicate"), timeout=TIMEOUT) as avg:
        for _ in range(3):
            avg.average_parameters(model.parameters())
        avg.synchronize(model.parameters())
    return _values(model)


def test_push_sum_on_a_world_converges_to_that_worlds_mean():
    for rank, values in enumerate(run_workers(_sgp_worker, 4, collective_timeout_s=20, timeout_s=90)):
        expected = sum(r + 1 for r in (rank % 2, rank % 2 + 2)) / 2
        assert values == pytest.approx([expected, expected]), rank


def _device_worlds_worker(rank, world_size, device):
    # worlds {0, 2} and {1, 3} as exchanged process groups; tensors on `device` (several ranks share one GPU)
    dev = rank_device(device, rank)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    world = as_world(groups[rank % 2])
    x = torch.full((1000,), float(rank + 1), device=dev)
    sums = []
    with WaitAvoidingGroupAllreduce(
        GroupSchedule.butterfly(2, 2), x, sync_period=2, max_lead=0, timeout=TIMEOUT, world=world
    ) as engine:
        for _ in range(5):
            res = engine(x)
            sums.append((float(res.sum[0]), str(res.sum.device)))
    model = _tagged(rank).to(dev)
    with WagmaAverager(2, 0, params=model.parameters(), world=world, timeout=TIMEOUT) as avg:
        avg.average_parameters(model.parameters())
    return sums, _values(model)


def check_two_worlds(device: str = "cpu") -> None:
    """Two worlds of 2 in a job of 4: every round sums its own world only, on ``device``'s tensors."""
    for rank, (sums, values) in enumerate(run_workers(_device_worlds_worker, 4, device, collective_timeout_s=30)):
        own = sum(r + 1 for r in (rank % 2, rank % 2 + 2))
        assert [s for s, _ in sums] == [float(own)] * 5, (rank, sums)
        assert all(d.startswith(device) for _, d in sums)
        assert values == pytest.approx([own / 2, own / 2])


@pytest.mark.slow  # 7 s: kept out of the 10-minute quick suite; CI's slow suite runs it
def test_two_worlds_on_exchanged_groups_sum_their_own_ranks():
    check_two_worlds("cpu")


def _disagree_worker(rank, world_size):
    mesh = _mesh()
    world = as_world((mesh, "replicate"))
    with pytest.raises(
        ValueError, match=r"rank 0 creates the group of world ranks \[0,1\] while rank 1 creates \[1,0\]"
    ):
        world.new_group([0, 1] if rank % 2 == 0 else [1, 0], TIMEOUT)
    return True


def test_worlds_that_ask_for_different_groups_are_told_so_instead_of_hanging():
    assert all(run_workers(_disagree_worker, 4, collective_timeout_s=20))


def _mixed_averagers_worker(rank, world_size):
    mesh = _mesh()
    model = _tagged(rank)
    timeout = datetime.timedelta(seconds=3)
    try:
        if rank % 2 == 0:  # world {0, 2}: WAGMA, whose engine creates groups the other world never asks for
            WagmaAverager(2, 4, params=model.parameters(), world=(mesh, "replicate"), timeout=timeout).close()
        else:
            with PeriodicAverager(1, world=(mesh, "replicate"), timeout=timeout) as avg:
                avg.average_parameters(model.parameters())
            time.sleep(6)  # stays alive past the other world's deadline
    except (TimeoutError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


@pytest.mark.slow  # waits out a timeout
def test_different_averagers_on_the_worlds_of_one_family_fail_in_bounded_time_naming_the_absent_ranks():
    start = time.monotonic()
    out = run_workers(_mixed_averagers_worker, 4, collective_timeout_s=20, timeout_s=60)
    assert time.monotonic() - start < 30
    assert out[1] == out[3] == "ok"
    for rank in (0, 2):
        assert out[rank].startswith("TimeoutError: World.new_group: rank(s) [1, 3] did not take part"), out[rank]


def _whole_group_worker(rank, world_size):
    everyone = dist.new_group(list(range(world_size)))
    world = as_world(everyone)  # a process group over the whole job: one world, the whole job
    return world.whole_job, world.ranks, world.rank


def test_a_process_group_over_every_rank_is_the_whole_job():
    for whole, ranks, _rank_in_world in run_workers(_whole_group_worker, 2, collective_timeout_s=20):
        assert whole and ranks == (0, 1)
    assert sorted(r[2] for r in run_workers(_whole_group_worker, 2, collective_timeout_s=20)) == [0, 1]
