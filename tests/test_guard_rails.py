"""Guard rails: double communication under DDP, an ``order`` a wrapper ignores, group sizes vs the world."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from wagma.averaging import (
    AveragingOptimizer,
    HierarchicalAverager,
    PeriodicAverager,
    ReductionMomentum,
    WagmaAverager,
)
from wagma.groups import contiguous_subgroups
from wagma.hooks import GroupAllreduceState, allreduce_hook, local_hook
from wagma.hooks.post_local import PostLocalState, post_local_hook
from wagma.schedule import GroupSchedule
from wagma.testing import error_messages, run_workers

TIMEOUT_S = 10.0
STEPS = 8
DOUBLE = "averages the parameters of a DistributedDataParallel model that still allreduces gradients"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step_fn: object) -> None:
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        step_fn(step)  # type: ignore[operator]


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


# -- 1. double communication: an averager on a DDP model that still allreduces gradients -------------------


def _double_communication_worker(rank: int, world: int) -> dict[str, list[str]]:
    torch.set_num_threads(1)
    out: dict[str, list[str]] = {}

    def run(case: str, hook: object, state: object, make_averager: object, *, hook_warmup: int = 0) -> None:
        net = _net()
        ddp = DDP(net)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        averager = make_averager(net)  # type: ignore[operator]

        def step(i: int) -> None:
            opt.step()
            averager.average_parameters(net.parameters())
            if isinstance(state, PostLocalState):
                state.step = i + 1  # as the recipes do: after the optimizer step and the average

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(ddp, opt, rank, step)
        averager.close()
        out[case] = _messages(caught)

    run("plain_ddp", None, None, lambda net: PeriodicAverager(1, timeout=TIMEOUT_S))
    run("local_hook", local_hook, None, lambda net: PeriodicAverager(1, timeout=TIMEOUT_S))
    run("post_local_matched", post_local_hook, PostLocalState(3), lambda net: PeriodicAverager(1, 3, timeout=TIMEOUT_S))
    run("post_local_in_warmup", post_local_hook, PostLocalState(3), lambda net: PeriodicAverager(2, timeout=TIMEOUT_S))
    run(
        "allreduce_hook_momentum",
        allreduce_hook,
        None,
        lambda net: ReductionMomentum(PeriodicAverager(2, timeout=TIMEOUT_S), momentum=0.5),
    )
    run(
        "wagma_plain_ddp",
        None,
        None,
        lambda net: WagmaAverager(2, 2, params=net.parameters(), order="step_then_average", timeout=TIMEOUT_S),
    )
    # Without DDP at all: nothing to warn about.
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    averager = AveragingOptimizer(opt, PeriodicAverager(1, timeout=TIMEOUT_S))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(net, opt, rank, lambda i: averager.step())
    averager.averager.close()
    out["no_ddp"] = _messages(caught)
    # Through AveragingOptimizer the warning points at the user's optimizer.step(), not into wagma.
    net = _net()
    ddp = DDP(net)
    opt = AveragingOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), PeriodicAverager(1, timeout=TIMEOUT_S))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(ddp, opt, rank, lambda i: opt.step())
    opt.averager.close()
    out["where"] = [w.filename for w in caught if issubclass(w.category, UserWarning)]
    return out


@pytest.mark.slow  # 4-6 s: moved out of the quick suite to keep it under 10 minutes
def test_double_communication_warns_once_and_only_when_ddp_still_allreduces() -> None:
    for out in run_workers(_double_communication_worker, 2, timeout_s=120):
        plain = out["plain_ddp"]
        assert len(plain) == 1, plain  # exactly once over STEPS reductions
        assert plain[0].startswith(f"PeriodicAverager {DOUBLE} (it has no comm hook")
        assert "register_comm_hook(PostLocalState(warmup_steps), post_local_hook)" in plain[0]
        assert out["where"] == [__file__]
        assert "local_hook" in plain[0]
        assert out["local_hook"] == []
        assert out["post_local_matched"] == []  # DDP's warm-up and the averager's warm-up do not overlap
        in_warmup = out["post_local_in_warmup"]
        assert (
            len(in_warmup) == 1 and "post_local_hook is still in its warm-up (step 0 < warmup_steps 3)" in in_warmup[0]
        )
        assert "the same warmup_steps for PeriodicAverager" in in_warmup[0]
        momentum = out["allreduce_hook_momentum"]
        assert len(momentum) == 1 and "wagma's allreduce_hook is registered" in momentum[0]
        wagma = out["wagma_plain_ddp"]
        assert len(wagma) == 1 and wagma[0].startswith(f"WagmaAverager {DOUBLE}")
        assert out["no_ddp"] == []


# -- 2. an order the wrapper ignores -------------------------------------------------------------------------


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params: object, events: list[str]) -> None:
        super().__init__(params, lr=0.1)  # type: ignore[arg-type]
        self.events = events

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.events.append("step")
        super().step()


def _order_worker(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.set_num_threads(1)
    out: dict[str, object] = {}
    # ReductionMomentum around an average-then-step WAGMA averager keeps that order under AveragingOptimizer.
    net, events = _net(), []
    inner = WagmaAverager(world, 2, params=net.parameters(), order="average_then_step", timeout=TIMEOUT_S)
    wrapped = ReductionMomentum(inner, momentum=0.5)
    original = wrapped.average_parameters

    def recording(*args: object, **kwargs: object) -> object:
        events.append("average")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    wrapped.average_parameters = recording  # type: ignore[method-assign]
    opt = AveragingOptimizer(_RecordingSGD(net.parameters(), events), wrapped)
    _train(net, opt, rank, lambda i: opt.step())
    wrapped.close()
    out["momentum_order"] = getattr(wrapped, "order", None)
    out["momentum_events"] = events[:4]
    # torch's PostLocalSGDOptimizer always steps first: an average-then-step averager warns, once.
    for order in ("average_then_step", "step_then_average"):
        net = _net()
        averager = WagmaAverager(world, 2, params=net.parameters(), order=order, timeout=TIMEOUT_S)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), averager)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(net, opt, rank, lambda i, opt=opt: opt.step())
        averager.close()
        out[f"post_local_sgd_{order}"] = _messages(caught)
    # wagma's AveragingOptimizer follows the order: no warning.
    net = _net()
    averager = WagmaAverager(world, 2, params=net.parameters(), order="average_then_step", timeout=TIMEOUT_S)
    opt = AveragingOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), averager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(net, opt, rank, lambda i: opt.step())
    averager.close()
    out["averaging_optimizer"] = _messages(caught)
    return out


@pytest.mark.slow  # 4-6 s: moved out of the quick suite to keep it under 10 minutes
def test_an_order_a_wrapper_would_ignore_is_passed_through_or_warned() -> None:
    for out in run_workers(_order_worker, 2, timeout_s=120):
        assert out["momentum_events"] == ["average", "step", "average", "step"]
        assert out["momentum_order"] == "average_then_step"
        ignored = out["post_local_sgd_average_then_step"]
        assert len(ignored) == 1, ignored
        assert ignored[0].startswith(
            "WagmaAverager has order='average_then_step', but torch's PostLocalSGDOptimizer ignores it"
        )
        assert "wagma.AveragingOptimizer" in ignored[0]
        assert out["post_local_sgd_step_then_average"] == []
        assert out["averaging_optimizer"] == []


def test_a_config_group_larger_than_the_world_says_so() -> None:
    from wagma.app.policies.options import validate_hierarchical, validate_wagma

    with pytest.raises(ValueError, match=r"^averaging.group_size 16 is larger than the world \(8 ranks\)"):
        validate_wagma({"group_size": 16, "sync_period": 2}, 8)
    with pytest.raises(ValueError, match=r"^averaging.local_group_size 4 is larger than the world \(2 ranks\)"):
        validate_hierarchical({"local_group_size": 4, "local_period": 1, "global_period": 2}, 2)


def test_an_order_key_for_a_policy_without_order_is_a_config_error() -> None:
    from wagma.app.policies.options import validate_local_sgd

    with pytest.raises(
        ValueError,
        match=r"averaging 'local_sgd' unknown keys: expected none \(it takes \[.*'period'.*\]\), found \['order'\]",
    ):
        validate_local_sgd({"period": 2, "order": "average_then_step"}, 2)


# -- 3. group sizes and the world ----------------------------------------------------------------------------


def test_schedule_refuses_a_group_larger_than_the_world() -> None:
    for kind in ("butterfly", "mixed_radix", "auto"):
        with pytest.raises(ValueError, match=r"group_size 16 is larger than the world \(8 ranks\): .*\(1, 2, 4, 8\)"):
            GroupSchedule.create(kind, 8, 16)
        with pytest.raises(ValueError, match=r"group_size 4 is larger than the world \(1 rank\)"):
            GroupSchedule.create(kind, 1, 4)
    from wagma.schedule import check_group_fits

    check_group_fits(8, 8)  # a group of everyone fits
    with pytest.raises(ValueError, match=r"^local_group_size 3 is larger than the world \(2 ranks\)"):
        check_group_fits(3, 2, "local_group_size")


def _group_size_worker(rank: int, world: int) -> dict[str, object]:
    torch.set_num_threads(1)
    net = _net()
    errors = error_messages(
        {
            "wagma": lambda: WagmaAverager(8, 2, params=net.parameters(), timeout=TIMEOUT_S),
            "group_hook": lambda: GroupAllreduceState(8, timeout=TIMEOUT_S),
            "hierarchical": lambda: HierarchicalAverager(8, 1, 2, timeout=TIMEOUT_S),
            "subgroups": lambda: contiguous_subgroups(8, list(range(world)), dist.default_pg_timeout),
        }
    )
    out: dict[str, object] = {"errors": errors}
    for name, args in {
        "local_one": (1, 2, 4),
        "local_world": (world, 2, 4),
        "equal_periods": (2, 4, 4),
        "hierarchical": (2, 1, 4),
    }.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            HierarchicalAverager(*args, warmup_steps=1, timeout=TIMEOUT_S).close()
        out[name] = _messages(caught)
    # The process group still works after the refusals (no rank was left inside a group creation).
    value = torch.ones(1)
    dist.all_reduce(value)
    out["sum"] = value.item()
    return out


def test_group_sizes_larger_than_the_world_and_degenerate_hierarchies() -> None:
    for out in run_workers(_group_size_worker, 4, timeout_s=120):
        errors = out["errors"]
        assert errors["wagma"].startswith("ValueError: group_size 8 is larger than the world (4 ranks)")
        assert errors["group_hook"].startswith("ValueError: group_size 8 is larger than the world (4 ranks)")
        assert errors["hierarchical"].startswith("ValueError: local_group_size 8 is larger than the world (4 ranks)")
        assert errors["subgroups"].startswith("ValueError: group_size 8 is larger than the world (4 ranks)")
        assert out["sum"] == 4.0
        prefix = "HierarchicalAverager is not hierarchical on this world: "
        [one] = out["local_one"]
        assert one.startswith(prefix + "local_group_size 1 makes every local mean a no-op")
        assert "a global mean every 4 step(s), as PeriodicAverager(period=4, warmup_steps=1) does" in one
        [everyone] = out["local_world"]
        assert everyone.startswith(prefix + "local_group_size 4 equals the world (4 ranks)")
        assert "PeriodicAverager(period=2, warmup_steps=1)" in everyone
        [periods] = out["equal_periods"]
        assert periods.startswith(prefix + "local_period equals global_period (4)")
        assert out["hierarchical"] == []


def test_hook_classification_knows_wagma_and_torch_hooks_and_trusts_custom_ones() -> None:
    import functools
    import types

    from torch.distributed.algorithms.ddp_comm_hooks import (
        default_hooks,
        post_localSGD_hook,
    )

    from wagma.averaging.guards import hook_communicates

    assert hook_communicates(default_hooks.allreduce_hook, None) == "torch's allreduce_hook is registered"
    assert hook_communicates(functools.partial(allreduce_hook), None) == "wagma's allreduce_hook is registered"
    assert hook_communicates(local_hook, None) is None
    state = PostLocalState(3)
    assert hook_communicates(post_local_hook, state) == (
        "post_local_hook is still in its warm-up (step 0 < warmup_steps 3)"
    )
    state.step = 3
    assert hook_communicates(post_local_hook, state) is None
    torch_state = types.SimpleNamespace(iter=1, start_localSGD_iter=4, post_local_gradient_allreduce=False)
    assert "iteration 1 < start_localSGD_iter 4" in hook_communicates(
        post_localSGD_hook.post_localSGD_hook, torch_state
    )
    torch_state.iter = 4
    assert hook_communicates(post_localSGD_hook.post_localSGD_hook, torch_state) is None

    def allreduce_hook_lookalike(state: object, bucket: object) -> None:  # a custom hook: not judged
        return None

    allreduce_hook_lookalike.__module__, allreduce_hook_lookalike.__qualname__ = "wagma.hooks.basic", "allreduce_hook"
    assert hook_communicates(allreduce_hook_lookalike, None) is None


def test_is_timeout_tells_a_passed_deadline_from_a_broken_connection():
    # One predicate for the averagers, the gossip exchanges and the engine's store clients (they used to repeat it).
    from torch.distributed import DistStoreError

    from wagma.groups import is_timeout

    assert is_timeout(TimeoutError("x")) and is_timeout(DistStoreError("wait timeout after 5000ms"))
    assert is_timeout(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error: Timed out"))
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_timeout(ValueError("bad input"))
