"""``ft=torchft`` under torchrun: each torchrun is one replica group, against a lighthouse started once.

``torchrun --standalone --nproc-per-node=K --max-restarts=N train.py ft=torchft ft.lighthouse=http://HOST:PORT
ft.first_replica=R`` makes this torchrun replica group ``R`` of a job whose lighthouse runs already (``python
train.py ft=torchft`` starts its own and supervises the replicas itself, :mod:`wagma.app.ft_launch`). Every rank
calls :func:`train_replica_group` from ``train.py``: it trains the group (:func:`wagma.app.ft_replica.train_replica`:
DDP over the K ranks, :class:`~wagma.integrations.torchft.ReplicaAverager` with the other groups) until the job
has committed its rounds. torchrun is the supervisor here: when a rank dies it stops the group and, within
``--max-restarts``, starts it again, and the new attempt heals from a live group. The group's rank 0 writes its
records into the run directory and, at the end, ``summary.json`` for this group.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from wagma.app import launch
from wagma.app.config import ConfigError, validate_config
from wagma.app.ft_replica import FT_DIR, train_replica
from wagma.app.ft_report import ft_summary
from wagma.app.metrics import write_summary

__all__ = ["train_replica_group"]


def _run_dir(cfg: DictConfig) -> Path:
    """``run_dir``, or the Hydra run directory (the same on every rank of one torchrun)."""
    if cfg.get("run_dir"):
        return Path(str(cfg.run_dir))
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def train_replica_group(cfg: DictConfig) -> None:
    """Train this torchrun's ranks as replica group ``ft.first_replica``; rank 0 writes ``summary.json``.

    Ends the process (status 0) when the group trained to the job's end, without the interpreter's teardown of
    torchft's threads.

    Raises:
        ConfigError: a bad config, or no ``ft.lighthouse`` (under torchrun the lighthouse is started once, apart).
    """
    if cfg.ft.get("lighthouse") is None:
        raise ConfigError(
            "ft.lighthouse: expected the address of a running lighthouse under torchrun, found None; start it once "
            "(torchft_lighthouse --bind [::]:29510 --min_replicas 2) and pass ft.lighthouse=http://HOST:29510, or "
            "run `python train.py ft=torchft replicas=N`, which starts one"
        )
    validate_config(cfg, launch.env_world_size())
    for name in ("torchft", "torchft_quorums", "torchft_commits"):  # a line per round at Hydra's INFO level
        logging.getLogger(name).setLevel(logging.WARNING)
    started = time.time()
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(job, DictConfig)
    run_dir = _run_dir(cfg)
    job.run_dir, job.replicas = str(run_dir), 1  # this torchrun runs one replica group
    (run_dir / FT_DIR).mkdir(parents=True, exist_ok=True)
    replica = int(job.ft.first_replica)
    final: dict[str, Any] = train_replica(job, run_dir, replica, str(job.ft.lighthouse))
    if launch.env_rank() == 0:
        lives = {replica: launch.restart_count() + 1}
        phases = (final["joined"] - started, time.time() - final["joined"])  # this attempt's
        write_summary(run_dir, ft_summary(job, {replica: final}, lives, [], phases))
        logging.getLogger(__name__).info("replica group %d: test accuracy %.4f", replica, final["test_accuracy"])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
