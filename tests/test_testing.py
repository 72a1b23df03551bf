"""The multi-process harness itself: values come back, failures are reported with their rank."""

import os
import signal
import time

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


def _note_setup(rank: int, world_size: int) -> str | None:
    os.environ["WAGMA_TEST_SETUP"] = f"{rank}/{world_size} before the group: {dist.is_initialized()}"
    return "127.0.0.1" if rank else None


def _read_setup(rank: int, world_size: int) -> str:
    return os.environ["WAGMA_TEST_SETUP"]


def _fail_setup(rank: int, world_size: int) -> None:
    raise RuntimeError(f"no network for rank {rank}")


def test_setup_runs_in_each_child_before_its_group_and_its_failure_is_the_ranks():
    assert run_workers(_read_setup, 2, setup=_note_setup) == [
        "0/2 before the group: False",
        "1/2 before the group: False",
    ]
    outs = run_workers_outcomes(_read_setup, 2, setup=_fail_setup, timeout_s=30)
    assert [o.ok for o in outs] == [False, False] and "RuntimeError: no network for rank 1" in outs[1].error


def test_rank_device_is_the_cpu_or_a_gpu_and_says_what_is_wrong():
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="^device kind: expected one of 'cpu', 'cuda', found 'tpu'$"):
        rank_device("tpu", 0)
    if torch.cuda.is_available():
        assert rank_device("cuda", 0).type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            rank_device("cuda", 0)


def test_error_messages_records_the_expected_errors_and_lets_others_through():
    def bad():
        raise ValueError("x must be > 0, got -1")

    assert error_messages({"bad": bad, "fine": lambda: None}) == {
        "bad": "ValueError: x must be > 0, got -1",
        "fine": None,
    }
    with pytest.raises(RuntimeError, match="other"):
        error_messages({"other": lambda: (_ for _ in ()).throw(RuntimeError("other"))})
    assert error_messages({"rt": lambda: (_ for _ in ()).throw(RuntimeError("r"))}, (RuntimeError,)) == {
        "rt": "RuntimeError: r"
    }


def test_a_rank_whose_setup_failed_before_the_store_was_announced_is_reported(monkeypatch):
    # The children whose setup fails may end before the parent sends them the store's port: the parent must not
    # fail on that pipe (BrokenPipeError), the ranks' own reports say what happened.
    import wagma.testing as testing

    slow = testing._store_port
    monkeypatch.setattr(testing, "_store_port", lambda: (time.sleep(1.0), slow())[1])
    outs = run_workers_outcomes(_read_setup, 2, setup=_fail_setup, timeout_s=30)
    assert [o.ok for o in outs] == [False, False] and "RuntimeError: no network for rank 1" in outs[1].error


def _sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(30)
    return rank


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_a_rank_still_running_at_the_deadline_is_killed_and_reported_and_the_world_size_is_checked():
    with pytest.raises(ValueError, match=r"^world_size: expected an integer >= 1, found 0$"):
        run_workers_outcomes(_sleep_on_rank_1, 0)
    outcomes = run_workers_outcomes(_sleep_on_rank_1, 2, timeout_s=3)
    assert outcomes[0].ok and outcomes[0].value == 0 and outcomes[0].exitcode == 0
    assert not outcomes[1].ok and outcomes[1].error == "did not finish within 3 s (killed)"
    assert outcomes[1].exitcode == -signal.SIGKILL
