"""Checkpoints: complete-or-absent under races, kills and full disks; verified resume; mismatches rejected."""

import errno
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from wagma.app import checkpoint
from wagma.app.checkpoint import checkpoint_dir, complete_steps, latest_step, load_checkpoint, read_meta
from wagma.app.train import train
from wagma.testing import run_workers, run_workers_outcomes

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _cfg(run_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=["progress=false", "averaging=allreduce", *overrides])
    cfg.run_dir = str(run_dir)
    return cfg


def _worker(rank: int, world_size: int, cfg: DictConfig, fault: tuple | None = None) -> dict:
    """``train(cfg)``, with an optional fault injected on one rank while it saves one step.

    ``fault = (kind, fault_rank, step)``: ``"kill_shard"`` SIGKILLs the rank as it is about to move its
    written shard into place, ``"kill_commit"`` as it is about to rename the checkpoint directory
    (meta.json written), ``"enospc"`` makes its fsync of its shard fail with ENOSPC, ``"enospc_meta"``
    its fsync of meta.json (rank 0's commit). ``("exit_after", None, step)`` ends every rank after that
    step, like a SIGKILL (no cleanup, no final checkpoint).
    """
    if fault is not None and fault[0] == "exit_after":
        return train(cfg, step_callback=lambda done, _: os._exit(9) if done == fault[2] else None)
    if fault is not None and fault[1] == rank:
        kind, _, step = fault
        tag = f"step_{step:08d}"
        real_replace, real_fsync = os.replace, os.fsync

        def replace(src, dst, **kwargs):
            if tag in str(dst) and (
                (kind == "kill_shard" and Path(dst).name == f"rank{rank}.pt")
                or (kind == "kill_commit" and Path(dst).name == tag)
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, **kwargs)

        def fsync(fd):
            name = os.readlink(f"/proc/self/fd/{fd}")
            if tag in name and (kind == "enospc" or (kind == "enospc_meta" and name.endswith("meta.json.tmp"))):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)

        os.replace, os.fsync = replace, fsync
    return train(cfg)


def _errors(outcomes) -> list[str]:
    assert not any(o.ok for o in outcomes), [o.value for o in outcomes if o.ok]
    return [o.error.strip().splitlines()[-1] for o in outcomes]


# --- saving: races, kills, full disks ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["wagma", pytest.param("local_sgd", marks=pytest.mark.slow)])
def test_checkpoint_every_step_on_four_ranks_completes_and_resumes(tmp_path, policy):
    # The old save let rank 0 delete older step directories while faster ranks wrote the next one.
    extra = ("averaging.sync_period=3",) if policy == "wagma" else ("averaging.period=2",)
    cfg = _cfg(tmp_path, f"averaging={policy}", *extra, "steps=12", "checkpoint_every=1", "model.hidden=[16]")
    run_workers(_worker, 4, cfg, timeout_s=120)
    assert complete_steps(tmp_path) == [11, 12]
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == ["step_00000011", "step_00000012"]
    cfg = _cfg(
        tmp_path, f"averaging={policy}", *extra, "steps=16", "checkpoint_every=1", "model.hidden=[16]", "resume=true"
    )
    summaries = run_workers(_worker, 4, cfg, timeout_s=120)
    assert [s["resumed_from"] for s in summaries] == [12] * 4 and complete_steps(tmp_path) == [15, 16]
    for rank in range(4):
        assert load_checkpoint(tmp_path, 16, rank)["step"] == 16


@pytest.mark.slow  # real kills: the slow phase, with the other fault tests (5.6 s each)
@pytest.mark.parametrize("kind,victim", [("kill_shard", 1), ("kill_commit", 0)])
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_resumable(tmp_path, kind, victim):
    cfg = _cfg(tmp_path, "steps=6", "checkpoint_every=2")
    outcomes = run_workers_outcomes(_worker, 3, cfg, (kind, victim, 4), timeout_s=60)
    assert outcomes[victim].exitcode == -signal.SIGKILL and not any(o.ok for o in outcomes)
    assert complete_steps(tmp_path) == [2]  # the half-saved step 4 is invisible ...
    assert (checkpoint_dir(tmp_path) / ".partial_step_00000004").is_dir()
    summaries = run_workers(_worker, 3, _cfg(tmp_path, "steps=6", "checkpoint_every=2", "resume=true"))
    assert [s["resumed_from"] for s in summaries] == [2, 2, 2]  # ... and step 2 resumes
    assert complete_steps(tmp_path) == [4, 6] and list(checkpoint_dir(tmp_path).glob(".*")) == []


@pytest.mark.parametrize(
    "kind,victim,who",
    [("enospc", 2, "rank 2 could not write its shard"), ("enospc_meta", 0, "rank 0 could not commit")],
)
def test_a_write_failing_with_enospc_on_one_rank_fails_every_rank_and_keeps_the_previous(tmp_path, kind, victim, who):
    cfg = _cfg(tmp_path, "steps=6", "checkpoint_every=2")
    errors = _errors(run_workers_outcomes(_worker, 3, cfg, (kind, victim, 4), timeout_s=60))
    for error in errors:
        assert error.startswith(f"wagma.app.checkpoint.CheckpointError: checkpoint of step 4 not saved: {who}")
        assert "No space left on device" in error and "the previous complete checkpoint (step 2) is untouched" in error
    assert complete_steps(tmp_path) == [2] and list(checkpoint_dir(tmp_path).glob(".*")) == []
    assert all(load_checkpoint(tmp_path, 2, r)["step"] == 2 for r in range(3))


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_really_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(tiny_disk):
    run_dir = tiny_disk / "run"
    run_workers(_worker, 2, _cfg(run_dir, "steps=2", "checkpoint_every=2"))
    shard = (checkpoint_dir(run_dir) / "step_00000002" / "rank0.pt").stat().st_size
    filler = tiny_disk / "filler"
    with open(filler, "wb") as f:  # leave less than one shard free
        free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
        f.write(b"\0" * max(0, free - shard // 2))
    errors = _errors(run_workers_outcomes(_worker, 2, _cfg(run_dir, "steps=4", "checkpoint_every=2", "resume=true")))
    assert all("checkpoint of step 4 not saved" in e and "No space left on device" in e for e in errors), errors
    assert complete_steps(run_dir) == [2]
    filler.unlink()
    summaries = run_workers(_worker, 2, _cfg(run_dir, "steps=4", "checkpoint_every=2", "resume=true"))
    assert summaries[0]["resumed_from"] == 2 and complete_steps(run_dir) == [2, 4]


@pytest.mark.parametrize(
    "world_size,overrides",
    [
        # 4.5 s, in the slow phase; two ranks resume in the quick suite (test_app.py, kill and resume)
        pytest.param(3, ("averaging=allreduce",), marks=pytest.mark.slow),
        pytest.param(  # resumed in the warm-up; 6 s, in the slow phase
            4,
            ("averaging=local_sgd", "averaging.warmup_steps=16", "averaging.period=2"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_resumed_ddp_run_at_three_or_more_ranks_is_bitwise_the_uninterrupted_one(tmp_path, world_size, overrides):
    # DDP rebuilds its buckets after its first iteration; gloo's sum order depends on the layout at P >= 3.
    common = ("model=cnn", "steps=20", "checkpoint_every=10", *overrides)
    run_workers(_worker, world_size, _cfg(tmp_path / "straight", *common), timeout_s=120)
    outcomes = run_workers_outcomes(_worker, world_size, _cfg(tmp_path / "broken", *common), ("exit_after", None, 13))
    assert all(o.exitcode == 9 for o in outcomes) and latest_step(tmp_path / "broken") == 10
    summaries = run_workers(_worker, world_size, _cfg(tmp_path / "broken", *common, "resume=true"), timeout_s=120)
    assert summaries[0]["resumed_from"] == 10
    a, b = (torch.load(tmp_path / run / "model.pt", weights_only=True) for run in ("straight", "broken"))
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


# --- resuming: verification and mismatches -------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A finished 2-rank run with complete checkpoints of steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run_workers(_worker, 2, _cfg(run_dir, "steps=4", "checkpoint_every=2"))
    assert complete_steps(run_dir) == [2, 4]
    return run_dir


def _copy(saved_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir


@pytest.mark.parametrize(
    "damage,problem",
    [
        ("flip", "is corrupt: its SHA-256 differs from the one meta.json records"),
        ("truncate", "is truncated or overwritten"),
        ("empty", "is empty (expected"),
    ],
)
def test_a_damaged_shard_fails_every_rank_with_one_line_naming_it(saved_run, tmp_path, damage, problem):
    run_dir = _copy(saved_run, tmp_path)
    shard = checkpoint_dir(run_dir) / "step_00000004" / "rank1.pt"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # one bit; inside tensor data it unpickles fine and is silently wrong
    else:
        data = data[: len(data) // 2] if damage == "truncate" else bytearray()
    shard.write_bytes(bytes(data))
    errors = _errors(run_workers_outcomes(_worker, 2, _cfg(run_dir, "steps=6", "checkpoint_every=2", "resume=true")))
    expected = f"wagma.app.checkpoint.CheckpointError: {shard} {problem}"
    assert all(e.startswith(expected) for e in errors), errors
    assert all(e.endswith(f"delete {shard.parent} to resume from step 2") for e in errors), errors


@pytest.mark.parametrize(
    "content,problem", [("", "is empty"), ('{"format": 1, "st', "is not valid checkpoint metadata")]
)
def test_damaged_metadata_fails_with_one_line_naming_it(saved_run, tmp_path, content, problem):
    run_dir = _copy(saved_run, tmp_path)
    meta = checkpoint_dir(run_dir) / "step_00000004" / "meta.json"
    meta.write_text(content)
    match = f"^{meta} {problem}.*delete .*step_00000004 to resume from step 2$"
    with pytest.raises(checkpoint.CheckpointError, match=match):
        read_meta(run_dir, 4)


@pytest.mark.parametrize(
    "overrides,world_size,message",
    [
        (
            ("averaging=local_sgd",),
            2,
            "was written with averaging={'bucket_cap_mb': 25, 'name': 'allreduce', "
            "'transport': 'default', 'wire_dtype': None}, "
            "this run has averaging={'average_buffers': True",
        ),
        ((), 3, "was written by 2 ranks, this run has 3; resume with 2 ranks"),
        (("model.hidden=[32]",), 2, "was written with model={'hidden': [128], 'name': 'mlp'}, this run has model="),
        (("optim=adam",), 2, "was written with optim="),
    ],
)
def test_resuming_with_another_policy_world_size_or_model_is_rejected(
    saved_run, tmp_path, overrides, world_size, message
):
    run_dir = _copy(saved_run, tmp_path)
    cfg = _cfg(run_dir, "steps=6", "checkpoint_every=2", "resume=true", *overrides)
    errors = _errors(run_workers_outcomes(_worker, world_size, cfg))
    prefix = "wagma.app.checkpoint.CheckpointError: the checkpoint "
    assert all(e.startswith(prefix) and message in e for e in errors), errors
    assert complete_steps(run_dir) == [2, 4]


def test_resume_policy_change_resets_only_the_policy_state(saved_run, tmp_path):
    run_dir = _copy(saved_run, tmp_path)
    cfg = _cfg(
        run_dir, "steps=6", "checkpoint_every=2", "resume=true", "averaging=local_sgd", "resume_policy_change=true"
    )
    summaries = run_workers(_worker, 2, cfg)
    assert summaries[0]["resumed_from"] == 4 and summaries[0]["policy"] == "local_sgd"
    assert summaries[0]["global_reductions"] == 1  # local_sgd's count from a fresh state: steps 4, 5 -> one mean
    assert read_meta(run_dir, 6)["fingerprint"]["averaging"]["name"] == "local_sgd"


def test_a_fresh_run_into_a_run_dir_with_history_is_refused(saved_run, tmp_path):
    run_dir = _copy(saved_run, tmp_path)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    errors = _errors(run_workers_outcomes(_worker, 2, _cfg(run_dir, "steps=6", "checkpoint_every=2")))
    assert all(
        e.startswith(
            f"wagma.app.checkpoint.CheckpointError: run directory {run_dir} already holds an earlier run "
            "(complete checkpoints up to step 4, metrics_rank0.jsonl, metrics_rank1.jsonl, summary.json)"
        )
        for e in errors
    ), errors
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing touched


def test_resume_picks_the_newest_complete_checkpoint_and_ignores_partial_ones(saved_run, tmp_path):
    run_dir = _copy(saved_run, tmp_path)
    shutil.copytree(checkpoint_dir(run_dir) / "step_00000004", checkpoint_dir(run_dir) / ".partial_step_00000006")
    (checkpoint_dir(run_dir) / "step_00000008").mkdir()  # no meta.json: not complete
    assert latest_step(run_dir) == 4
    summaries = run_workers(_worker, 2, _cfg(run_dir, "steps=6", "checkpoint_every=2", "resume=true"))
    assert summaries[0]["resumed_from"] == 4


def test_resume_with_no_checkpoint_starts_from_step_zero(tmp_path):
    summaries = run_workers(_worker, 2, _cfg(tmp_path, "steps=2", "checkpoint_every=0", "resume=true"))
    assert summaries[0]["resumed_from"] is None and complete_steps(tmp_path) == [2]


def _save_twice_worker(rank: int, world_size: int, run_dir: Path) -> list[int]:
    for version in (1, 2, 3):
        checkpoint.save_checkpoint(run_dir, 5 if version > 1 else 3, {"version": version, "rank": rank}, keep=2)
    return complete_steps(run_dir)


def test_saving_a_step_again_replaces_it_and_keeps_the_older_one(tmp_path):
    assert run_workers(_save_twice_worker, 2, tmp_path) == [[3, 5], [3, 5]]
    assert [load_checkpoint(tmp_path, 5, r) for r in range(2)] == [{"version": 3, "rank": 0}, {"version": 3, "rank": 1}]
    assert load_checkpoint(tmp_path, 3, 1) == {"version": 1, "rank": 1}
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == ["step_00000003", "step_00000005"]


def test_counters_of_a_checkpoint_from_before_samples_were_counted_count_its_batches():
    """Older checkpoints lack ``samples``: their steps held ``batch_size`` examples each, and samples/s must
    count them (counting only the steps after the resume would understate throughput)."""
    from wagma.app.assembly import restored_totals as _restored_totals
    from wagma.app.data import BatchIterator

    batches = BatchIterator(torch.zeros(40, 2), torch.zeros(40, dtype=torch.long), 8, seed=0, rank=0)
    old = {"steps": 5, "train_s": 1.0, "compute_s": 0.5, "wait_s": 0.2, "imbalance_s": 0.0, "elapsed_s": 2.0}
    assert _restored_totals(old, batches).samples == 40
    assert _restored_totals(old | {"samples": 33}, batches).samples == 33  # a counted total is kept as it is
