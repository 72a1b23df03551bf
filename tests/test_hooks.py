"""DDP communication hooks: parity with DDP's default, group means in closed form, pickling, the registry."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import wagma.hooks as hooks
from wagma.hooks import AllreduceState, GroupAllreduceState, allreduce_hook, group_allreduce_hook, local_hook
from wagma.testing import run_workers

TIMEOUT_S = 10.0


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))


def _ddp_parity(rank: int, world: int, transport: str = "default") -> float:
    plain = DDP(_tiny_model())
    hooked = DDP(_tiny_model(), bucket_cap_mb=0.00005)  # several buckets: each goes through the hook
    state = AllreduceState(transport=transport, params=list(hooked.parameters()))
    hooked.register_comm_hook(state, allreduce_hook)
    if transport == "shm":  # every bucket through shared memory
        reduce, calls = state.shm.all_reduce, []
        state.shm.all_reduce = lambda t, out=None: calls.append(t.numel()) or reduce(t, out)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, hooked)]
    worst = 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 2, generator=gen)
        for model, opt in zip((plain, hooked), opts):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        for a, b in zip(plain.parameters(), hooked.parameters()):
            assert a.grad is not None and b.grad is not None
            worst = max(worst, (a.grad - b.grad).abs().max().item())
        for opt in opts:
            opt.step()
    if transport == "shm":
        # Every gradient of every step, one bucket after the first step (DDP rebuilds its buckets) and two after.
        assert len(calls) > 3 and sum(calls) == 3 * sum(p.numel() for p in hooked.parameters()), calls
    return worst


@pytest.mark.parametrize("world", [3, 4])
def test_allreduce_hook_matches_ddp_default(world):
    out = run_workers(_ddp_parity, world, collective_timeout_s=TIMEOUT_S)
    assert max(out) <= 1e-7, out


def test_allreduce_hook_through_shared_memory_matches_ddp_default():
    out = run_workers(_ddp_parity, 3, "shm", collective_timeout_s=TIMEOUT_S)
    assert max(out) <= 1e-7, out


def test_shared_memory_allreduce_state_needs_the_parameters_and_drops_its_segment_when_pickled():
    with pytest.raises(ValueError, match="transport 'shm' needs the parameters DDP reduces"):
        AllreduceState(transport="shm")
    with pytest.raises(ValueError, match="expected one of 'default', 'shm'"):
        AllreduceState(transport="tcp")


def _grads_with_hook(rank: int, world: int, name: str, state_kwargs: dict) -> list[float]:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = DDP(model)
    hook, make_state = hooks.get(name)
    ddp.register_comm_hook(make_state(**state_kwargs), hook)
    ddp(torch.full((1, 2), float(rank + 1))).sum().backward()  # local gradient: rank + 1 everywhere
    return model.weight.grad.reshape(-1).tolist()


@pytest.mark.parametrize(
    "world, group_size, expected",
    [
        (6, 3, [2.0, 2.0, 2.0, 5.0, 5.0, 5.0]),  # means of 1..3 and 4..6
        (4, 2, [1.5, 1.5, 3.5, 3.5]),
        (3, 1, [1.0, 2.0, 3.0]),  # groups of one: no communication
        pytest.param(3, 3, [2.0, 2.0, 2.0], marks=pytest.mark.slow),  # one group: the global mean
    ],
)
def test_group_allreduce_hook_means_inside_contiguous_groups(world, group_size, expected):
    out = run_workers(
        _grads_with_hook,
        world,
        "group_allreduce",
        {"group_size": group_size, "timeout": TIMEOUT_S},
        collective_timeout_s=TIMEOUT_S,
    )
    assert out == [pytest.approx([e, e]) for e in expected]


def test_local_hook_keeps_local_gradients_world3():
    out = run_workers(_grads_with_hook, 3, "local", {}, collective_timeout_s=TIMEOUT_S)
    assert out == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_allreduce_hook_by_name_is_the_global_mean_world3():
    out = run_workers(_grads_with_hook, 3, "allreduce", {}, collective_timeout_s=TIMEOUT_S)
    assert out == [[2.0, 2.0]] * 3


def _pickling(rank: int, world: int) -> dict:
    sub = dist.new_group()
    state = pickle.loads(pickle.dumps(AllreduceState(process_group=sub)))  # a ProcessGroup does not pickle
    group_state = GroupAllreduceState(3, timeout=TIMEOUT_S)
    restored = pickle.loads(pickle.dumps(group_state))
    out = {
        "allreduce_group": state.process_group,
        "group_size": restored.group_size,
        "blocks": restored.blocks,
        "subgroup": restored.subgroup,
        "created": restored.groups_created,
        "original_kept": group_state.subgroup is not None,
    }
    with pytest.raises(RuntimeError, match=r"call state.create_groups\(\) on every rank"):
        group_allreduce_hook(restored, None)  # type: ignore[arg-type]
    restored.create_groups()  # collective: every rank rebuilds
    t = torch.full((2,), float(rank))
    out["rebuilt"] = restored.subgroup is not None and dist.get_process_group_ranks(restored.subgroup)
    dist.all_reduce(t, group=restored.subgroup)
    out["sum"] = t.tolist()
    return out


def test_pickling_a_hook_state_drops_its_process_groups_world6():
    out = run_workers(_pickling, 6, collective_timeout_s=TIMEOUT_S)
    for rank, r in enumerate(out):
        assert r["allreduce_group"] is None and r["subgroup"] is None and not r["created"]
        assert r["original_kept"] and r["group_size"] == 3
        assert r["blocks"] == [[0, 1, 2], [3, 4, 5]]
        assert r["rebuilt"] == ([0, 1, 2] if rank < 3 else [3, 4, 5])
        assert r["sum"] == ([3.0, 3.0] if rank < 3 else [12.0, 12.0])


def _group_state_validation(rank: int, world: int) -> bool:
    with pytest.raises(ValueError, match=r"group_size: expected a divisor of the number of ranks \(6\), found 4"):
        GroupAllreduceState(4)
    with pytest.raises(ValueError, match=r"process_group: expected a ProcessGroup or None"):
        AllreduceState(process_group=3)  # type: ignore[arg-type]
    return True


def test_group_state_bad_arguments_world6():
    assert run_workers(_group_state_validation, 6, collective_timeout_s=TIMEOUT_S) == [True] * 6


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GroupAllreduceState(0), r"group_size: expected an integer >= 1, found 0"),
        (lambda: GroupAllreduceState(2, timeout=-1.0), r"timeout: expected a positive duration"),
    ],
)
def test_group_state_rejects_bad_arguments_before_creating_groups(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- the registry --------------------------------------------------------------------------------------------


def test_registry_lists_the_builtin_hooks():
    assert {"allreduce", "group_allreduce", "local"} <= set(hooks.available())
    assert hooks.get("allreduce") == (allreduce_hook, AllreduceState)
    assert hooks.get("group_allreduce") == (group_allreduce_hook, GroupAllreduceState)
    hook, make_state = hooks.get("local")
    assert hook is local_hook and make_state() is None


def test_unknown_hook_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"hook name: expected one of \['allreduce', .*'local'.*\], found 'solo'"):
        hooks.get("solo")


def test_register_adds_a_name_and_refuses_duplicates():
    def my_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return local_hook(state, bucket)

    try:
        hooks.register("test_only_hook", my_hook, dict)
        assert "test_only_hook" in hooks.available()
        assert hooks.get("test_only_hook") == (my_hook, dict)
        with pytest.raises(ValueError, match=r"expected a new hook name, found 'test_only_hook' already registered"):
            hooks.register("test_only_hook", my_hook, dict)
        hooks.register("test_only_hook", local_hook, dict, replace=True)
        assert hooks.get("test_only_hook")[0] is local_hook
    finally:
        hooks._REGISTRY.pop("test_only_hook", None)
    with pytest.raises(ValueError, match=r"name: expected a non-empty string, found ''"):
        hooks.register("", my_hook, dict)
    with pytest.raises(ValueError, match=r"hook and state_factory: expected callables"):
        hooks.register("x", None, dict)  # type: ignore[arg-type]


def _group_state_lifetime(rank: int, world: int) -> tuple[bool, bool, bool, bool]:
    import gc

    pg_map = dist.distributed_c10d._world.pg_map
    with GroupAllreduceState(2, timeout=TIMEOUT_S) as state:
        group = state.subgroup
        alive_inside = group in pg_map
    closed = group not in pg_map and not state.groups_created
    dropped = GroupAllreduceState(2, timeout=TIMEOUT_S)
    group = dropped.subgroup
    dropped.cycle = dropped  # a reference cycle: only the garbage collector can drop it
    del dropped
    gc.collect()
    try:
        group_allreduce_hook(state, None)  # type: ignore[arg-type]
        raises = False
    except RuntimeError as err:
        raises = "closed" in str(err)
    return alive_inside, closed, group not in pg_map, raises


def test_group_state_is_a_context_manager_and_released_when_dropped_world4():
    assert run_workers(_group_state_lifetime, 4, collective_timeout_s=TIMEOUT_S) == [(True, True, True, True)] * 4
