"""Per-rank training checkpoints in the shared run directory, committed together.

Layout under ``<run_dir>/checkpoints/``::

    step_00000040/rank0.pt, rank1.pt, ...   one file per rank (replicas may differ between averagings,
                                            and optimizer state is always local)
    latest                                  text: the step of the newest *complete* checkpoint

Every rank writes its file (to a temporary name, then renamed), all ranks meet at a barrier, and only
then rank 0 points ``latest`` at the new step and deletes older step directories. A run killed while
saving therefore resumes from the previous complete checkpoint. Files hold plain containers and tensors
only, so they load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "capture_rng_state", "checkpoint_dir", "latest_step", "load_checkpoint", "restore_rng_state", "save_checkpoint",
]


def checkpoint_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The directory that holds a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The step of the newest complete checkpoint, or None when there is none."""
    marker = checkpoint_dir(run_dir) / "latest"
    if not marker.exists():
        return None
    return int(marker.read_text(encoding="utf-8").strip())


def save_checkpoint(run_dir: str | os.PathLike[str], step: int, state: dict[str, Any]) -> None:
    """Save this rank's ``state`` as the checkpoint of ``step``; collective over the default group.

    Every rank must call it with the same ``step``. Returns once the checkpoint is complete on all ranks.
    """
    rank = dist.get_rank()
    root = checkpoint_dir(run_dir)
    target = _step_dir(root, step)
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"rank{rank}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    dist.barrier()
    if rank == 0:
        marker_tmp = root / "latest.tmp"
        marker_tmp.write_text(f"{step}\n", encoding="utf-8")
        os.replace(marker_tmp, root / "latest")
        for old in root.glob("step_*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(run_dir: str | os.PathLike[str], step: int, rank: int) -> dict[str, Any]:
    """Load rank ``rank``'s state from the checkpoint of ``step`` onto the CPU."""
    path = _step_dir(checkpoint_dir(run_dir), step) / f"rank{rank}.pt"
    if not path.exists():
        raise RuntimeError(
            f"checkpoint {path} is missing: the checkpoint of step {step} was written by a different number "
            "of ranks; resume with the world size of the saved run"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and Python generator states, as plain values."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
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
