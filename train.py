"""Train with wagma: ``torchrun --standalone --nproc_per_node=4 train.py [hydra overrides]``.

The work happens in :func:`wagma.train.train`; this file only hands it the composed config. Under
torchrun every rank resolves the same run directory (``outputs/<date>/<time>`` from one shared start
time, or ``hydra.run.dir=DIR``), only rank 0 writes Hydra's ``.hydra/`` and log file there, and a bad
config is reported once, by rank 0, with exit status 2 on every rank. See :mod:`wagma.launch`.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from wagma import launch
from wagma.config import ConfigError
from wagma.train import train

launch.register_resolvers()


@hydra.main(config_path="configs", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    """Run :func:`wagma.train.train`; end a bad config with one message and exit status 2."""
    launch.release_stderr()
    try:
        train(cfg)
    except ConfigError as err:
        if launch.env_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv += launch.hydra_rank_overrides(sys.argv[1:], launch.env_rank())
    with launch.failures_reported_by_rank0():
        main()
