"""The multi-process harness itself: values come back, failures are reported with their rank."""

import os

import pytest
import torch
import torch.distributed as dist

from wagma.testing import WorkerError, error_messages, rank_device, run_workers, run_workers_outcomes


def _allreduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_values_come_back_in_rank_order(world_size):
    out = run_workers(_allreduce_rank, world_size)
    assert out == [float(sum(range(world_size)))] * world_size


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_worker_traceback_is_tagged_with_rank():
    with pytest.raises(WorkerError, match=r"(?s)rank 1 ---.*ValueError: boom on purpose"):
        run_workers(_raise_on_rank_1, 3)


def _exit_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def test_dead_rank_is_reported_with_exit_code():
    outs = run_workers_outcomes(_exit_rank_0, 2)
    assert not outs[0].ok and outs[0].exitcode == 3
    assert outs[1].ok and outs[1].value == 1


def test_rank_device_is_the_cpu_or_a_gpu_and_says_what_is_wrong():
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="device kind must be 'cpu' or 'cuda', got 'tpu'"):
        rank_device("tpu", 0)
    if torch.cuda.is_available():
        assert rank_device("cuda", 0).type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            rank_device("cuda", 0)


def test_error_messages_records_the_expected_errors_and_lets_others_through():
    def bad():
        raise ValueError("x must be > 0, got -1")

    assert error_messages({"bad": bad, "fine": lambda: None}) == {"bad": "ValueError: x must be > 0, got -1",
                                                                  "fine": None}
    with pytest.raises(RuntimeError, match="other"):
        error_messages({"other": lambda: (_ for _ in ()).throw(RuntimeError("other"))})
    assert error_messages({"rt": lambda: (_ for _ in ()).throw(RuntimeError("r"))}, (RuntimeError,)) == {
        "rt": "RuntimeError: r"}
