"""Per-rank training checkpoints in the shared run directory: complete or absent, verified on load.

Layout under ``<run_dir>/checkpoints/``::

    step_00000040/rank0.pt ... rank{P-1}.pt   one shard per rank (torch.save of plain containers and tensors)
    step_00000040/meta.json                   written last: step, world size, the run's fingerprint
                                              (averaging, model, optimizer config) and every shard's
                                              size and SHA-256
    .partial_step_00000041/                   a save in progress, or one that died; never read

Protocol of :func:`save_checkpoint` (collective over the default group, whose timeout bounds every wait):

1. every rank serialises its state in memory, writes it to ``.partial_step_N/rank{r}.pt`` (temporary
   name, fsync, rename) and hashes the bytes it wrote;
2. ``all_gather_object`` of every rank's ``(size, sha256)`` or its error -- the barrier;
3. rank 0 alone, only if every rank succeeded: writes ``meta.json`` (temporary name, fsync, rename)
   into the partial directory and renames the directory to ``step_N`` -- one atomic rename makes the
   checkpoint visible with every shard in place. Then it deletes complete checkpoints older than the
   ``keep`` newest and partial directories of older steps (every rank is past them: step 2 proved it);
4. ``broadcast_object_list`` of rank 0's outcome, so every rank returns, or every rank raises the same
   :class:`CheckpointError` (a full disk on any rank included), and no rank runs ahead into the next
   save while rank 0 still cleans up.

A rank killed anywhere in this leaves at most a partial directory: the previous complete checkpoint
stays the newest visible one. Resume (:func:`load_checkpoint`) picks the newest *complete* checkpoint;
each rank checks its shard's size and SHA-256 against ``meta.json`` before unpickling, and the ranks
agree on the outcome, so a bad shard fails every rank with one line naming the file. If the newest
complete checkpoint is corrupt, resume **fails** (it does not fall back silently: a different starting
point changes the run); the message names the previous complete checkpoint and says to delete the bad
one to resume from there. ``keep=2`` (the default) keeps that previous one around.

Why not ``torch.distributed.checkpoint`` (DCP): DCP saves one *global* state dict and deduplicates
plain tensors that several ranks hold under the same key, keeping one copy. Under WAGMA and local SGD
the replicas differ between averagings and optimizer state is always local, so every key would need a
rank prefix -- which gives up the resharding that is DCP's reason to exist, since a checkpoint of P
ranks still only resumes on P ranks (each rank's data shard and RNG streams are tied to its rank).
DCP also records no checksum of its files, writes in place (no complete-or-absent commit) and runs its
planning collectives on the default group without a per-call deadline. Its remaining benefit, parallel
per-rank files, is what this module does with plain ``torch.save``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from wagma.checks import check_int, fail

__all__ = [
    "RESETTABLE",
    "CheckpointError",
    "capture_rng_state",
    "checkpoint_dir",
    "complete_steps",
    "ensure_no_history",
    "latest_step",
    "load_checkpoint",
    "read_meta",
    "restore_rng_state",
    "resume_checkpoint",
    "save_checkpoint",
]

FORMAT = 1
META = "meta.json"
_STEP_DIR = re.compile(r"step_(\d{8})")
_PARTIAL_DIR = re.compile(r"\.partial_step_(\d{8})")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or cannot be resumed from; the message is one line."""


def checkpoint_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The directory that holds a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_steps(run_dir: str | os.PathLike[str]) -> list[int]:
    """Steps of the complete checkpoints (a ``step_N`` directory holding ``meta.json``), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / META).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The step of the newest complete checkpoint, or None when there is none."""
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def _fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, durably; a failure leaves ``path`` as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written file would hold on to the space a full disk needs
        raise


def _write_shard(directory: Path, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    _fsync_write(directory / f"rank{rank}.pt", data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    state: dict[str, Any],
    *,
    fingerprint: dict[str, Any] | None = None,
    keep: int = 2,
) -> None:
    """Save this rank's ``state`` as the checkpoint of ``step``; collective over the default group.

    Every rank must call it with the same ``step`` (and, on rank 0, the ``fingerprint`` that counts).
    Returns on every rank once the checkpoint is complete and visible; see the module docstring.

    Args:
        run_dir: the run directory every rank sees.
        step: the number of completed steps the state holds.
        state: this rank's training state (plain containers and tensors).
        fingerprint: JSON-able description of the run (rank 0's is recorded in ``meta.json``), checked
            on resume.
        keep: complete checkpoints to keep (at least 1); older ones are deleted after this one is complete.

    Raises:
        ValueError: for ``keep < 1`` or a negative step.
        CheckpointError: on every rank, if any rank could not write its shard (e.g. a full disk) or
            rank 0 could not commit; the previous complete checkpoint is then untouched.
    """
    check_int("keep", keep, 1)
    check_int("step", step, 0)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    root = checkpoint_dir(run_dir)
    partial = root / f".partial_step_{step:08d}"
    try:
        partial.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] | str = _write_shard(partial, rank, state)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        report = f"rank {rank} could not write its shard {partial / f'rank{rank}.pt'}: {exc}"
    reports: list[Any] = [None] * world_size
    dist.all_gather_object(reports, report)
    outcome: list[str | None] = [None]
    if rank == 0:
        outcome[0] = _commit(root, partial, step, reports, fingerprint or {}, keep)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])


def _commit(
    root: Path, partial: Path, step: int, reports: list[Any], fingerprint: dict[str, Any], keep: int
) -> str | None:
    """Rank 0: make the checkpoint visible and clean up; return None, or the one-line reason it failed."""
    previous = latest_step(root.parent)
    keeps = f"the previous complete checkpoint ({'step ' + str(previous) if previous is not None else 'none'})"
    errors = [r for r in reports if isinstance(r, str)]
    if not errors:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": len(reports),
            "fingerprint": fingerprint,
            "shards": {f"rank{r}.pt": report for r, report in enumerate(reports)},
        }
        final, aside = _step_dir(root, step), root / f".replaced_step_{step:08d}"
        moved_aside = False
        try:
            _fsync_write(partial / META, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
            if final.exists():  # the same step saved again; a rename cannot replace a non-empty directory
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                moved_aside = True
            os.replace(partial, final)
            _fsync_dir(root)
        except OSError as exc:
            errors.append(f"rank 0 could not commit {partial / META}: {exc}")
            if moved_aside and not final.exists():
                os.replace(aside, final)  # put the earlier checkpoint of this step back
        shutil.rmtree(aside, ignore_errors=True)
    if errors:
        shutil.rmtree(partial, ignore_errors=True)  # every rank is done with it; free what it holds
        return (
            f"checkpoint of step {step} not saved: {'; '.join(errors)}; {keeps} is untouched and resumable; "
            "free disk space or fix the path, then resume with resume=true"
        )
    kept = set(complete_steps(root.parent)[-keep:])
    for old in root.iterdir():
        complete, partial_match = _STEP_DIR.fullmatch(old.name), _PARTIAL_DIR.fullmatch(old.name)
        if complete and int(complete.group(1)) < step and int(complete.group(1)) not in kept:
            (old / META).unlink(missing_ok=True)  # first: a deletion cut short leaves no "complete" remains
            shutil.rmtree(old, ignore_errors=True)
        elif partial_match and int(partial_match.group(1)) < step:  # a save that died: every rank is past it
            shutil.rmtree(old, ignore_errors=True)
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(run_dir: str | os.PathLike[str], step: int) -> dict[str, Any]:
    """The ``meta.json`` of the complete checkpoint of ``step``.

    Raises:
        CheckpointError: naming the file, if it is missing, empty, truncated or not what this module writes.
    """
    path = _step_dir(checkpoint_dir(run_dir), step) / META
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}{_fallback(run_dir, step)}") from None
    if not text.strip():
        raise CheckpointError(f"{path} is empty{_fallback(run_dir, step)}")
    try:
        meta = json.loads(text)
        ok = meta["format"] == FORMAT and meta["step"] == step and isinstance(meta["shards"], dict)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not valid checkpoint metadata ({exc}){_fallback(run_dir, step)}") from None
    if not ok:
        raise CheckpointError(f"{path} is not metadata of step {step} in format {FORMAT}{_fallback(run_dir, step)}")
    return meta


def _fallback(run_dir: str | os.PathLike[str], step: int) -> str:
    """What to do about a bad checkpoint of ``step``: delete it, and which one resume then takes."""
    older = [s for s in complete_steps(run_dir) if s < step]
    where = f"resume from step {older[-1]}" if older else "start afresh"
    return f"; delete {_step_dir(checkpoint_dir(run_dir), step)} to {where}"


def load_checkpoint(run_dir: str | os.PathLike[str], step: int, rank: int) -> dict[str, Any]:
    """Load rank ``rank``'s shard of the checkpoint of ``step`` onto the CPU, after verifying it.

    Raises:
        CheckpointError: one line naming the file, if the shard is missing, empty, truncated or its
            SHA-256 differs from the one ``meta.json`` records, or if the checkpoint has no shard for
            ``rank`` (written by fewer ranks).
    """
    meta = read_meta(run_dir, step)
    directory = _step_dir(checkpoint_dir(run_dir), step)
    path = directory / f"rank{rank}.pt"
    expected = meta["shards"].get(path.name)
    if expected is None:
        raise CheckpointError(
            f"{directory} holds no shard for rank {rank}: it was written by {meta.get('world_size')} ranks; "
            "resume with the world size of the saved run"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}{_fallback(run_dir, step)}") from None
    problem = None
    if not data:
        problem = f"is empty (expected {expected['bytes']} bytes)"
    elif len(data) != expected["bytes"]:
        problem = f"is truncated or overwritten: {len(data)} bytes, {META} records {expected['bytes']}"
    elif hashlib.sha256(data).hexdigest() != expected["sha256"]:
        problem = f"is corrupt: its SHA-256 differs from the one {META} records"
    if problem is not None:
        raise CheckpointError(f"{path} {problem}{_fallback(run_dir, step)}")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - intact bytes that this torch cannot read (another version?)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is intact but cannot be loaded: {first}") from None


#: Fingerprint entries that runs recorded only from some version on, with the value of every run before.
_FINGERPRINT_DEFAULTS: dict[str, Any] = {"parallel": "ddp", "shard_size": 1}

RESETTABLE = ("averaging",)
"""Fingerprint entries a resume may be told to accept changed (their state then starts fresh)."""


def resume_checkpoint(
    run_dir: str | os.PathLike[str], fingerprint: dict[str, Any], *, allow_changed: tuple[str, ...] = ()
) -> tuple[int, dict[str, Any], list[str]] | None:
    """Collective: this rank's verified state from the newest complete checkpoint, or None if there is none.

    Rank 0 picks the step (so all ranks agree); every rank checks the checkpoint's world size and
    fingerprint against this run's and verifies and loads its own shard; the ranks then agree, so a
    problem on any rank raises the same one-line :class:`CheckpointError` on every rank.

    Args:
        run_dir: the run directory.
        fingerprint: this run's description, as passed to :func:`save_checkpoint`.
        allow_changed: entries of :data:`RESETTABLE` that may differ; the caller resets their state.

    Returns:
        ``(step, state, changed)`` with ``changed`` the allowed entries that differ, or None.
    """
    if not set(allow_changed) <= set(RESETTABLE):
        raise fail("allow_changed", f"entries of {RESETTABLE}", allow_changed)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chosen: list[int | None] = [latest_step(run_dir) if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    step = chosen[0]
    if step is None:
        return None
    changed: list[str] = []
    state: dict[str, Any] = {}
    try:
        meta = read_meta(run_dir, step)
        where = f"the checkpoint {_step_dir(checkpoint_dir(run_dir), step)}"
        if meta["world_size"] != world_size:
            raise CheckpointError(
                f"{where} was written by {meta['world_size']} ranks, this run has {world_size}; resume with "
                f"{meta['world_size']} ranks (every rank's data shard and random streams belong to its rank)"
            )
        # An entry newer than the checkpoint (or than the caller) takes the value every run had before it.
        saved = _FINGERPRINT_DEFAULTS | meta.get("fingerprint", {})
        fingerprint = _FINGERPRINT_DEFAULTS | fingerprint
        for key in sorted(set(saved) | set(fingerprint)):
            if saved.get(key) == fingerprint.get(key):
                continue
            if key not in allow_changed:
                flag = " or set resume_policy_change=true to resume with its state reset" if key in RESETTABLE else ""
                raise CheckpointError(
                    f"{where} was written with {key}={saved.get(key)}, this run has {key}={fingerprint.get(key)}; "
                    f"resume with the saved {key}{flag}"
                )
            changed.append(key)
        state = load_checkpoint(run_dir, step, rank)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    errors: list[str | None] = [None] * world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)
    return step, state, changed


def ensure_no_history(run_dir: str | os.PathLike[str]) -> None:
    """Collective: refuse to start a fresh run (``resume=false``) in a directory holding an earlier run.

    An earlier run's history is a complete checkpoint, a ``metrics_rank*.jsonl`` file or ``summary.json``;
    a fresh run would overwrite or delete it. Rank 0 looks (ranks that look later could see rank 0's
    own new files) and every rank raises the same :class:`CheckpointError`.
    """
    found: list[str | None] = [None]
    if dist.get_rank() == 0:
        run = Path(run_dir)
        what = [f"complete checkpoints up to step {s}" for s in [latest_step(run)] if s is not None]
        what += sorted(p.name for p in run.glob("metrics_rank*.jsonl"))
        what += ["summary.json"] if (run / "summary.json").exists() else []
        if what:
            found[0] = (
                f"run directory {run} already holds an earlier run ({', '.join(what)}); pass resume=true to "
                "continue it, or choose another run_dir -- a fresh run would overwrite that history"
            )
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        raise CheckpointError(found[0])


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and Python generator states, as plain values."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
