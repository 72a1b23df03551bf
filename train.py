"""Train with wagma: ``torchrun --standalone --nproc_per_node=4 train.py [hydra overrides]``.

The work happens in :func:`wagma.app.train.train`; this file only hands it the composed config. Under
torchrun every rank resolves the same run directory (``outputs/<date>/<time>`` from the job's start
time, or ``hydra.run.dir=DIR``), only rank 0 writes Hydra's ``.hydra/`` and log file there, and a bad
config is reported once, by rank 0, with exit status 2 on every rank. Any other failure is recorded with
torch.distributed.elastic's ``@record``: the exception (for a failed step, naming the ranks that did not
arrive) goes to torchrun's error file, so torchrun's final report shows the real cause. With
``torchrun --max-restarts N`` a restarted job resumes from its newest complete checkpoint. See
:mod:`wagma.app.launch`.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from wagma.app import launch
from wagma.app.config import ConfigError
from wagma.app.train import train

launch.register_resolvers()


@record
def run(cfg: DictConfig) -> None:
    """Train; end a bad config with one message and exit status 2 (no error file: every rank shares it).

    Any other exception is written to ``$TORCHELASTIC_ERROR_FILE`` (torchrun's report) and re-raised.
    """
    try:
        train(cfg)
    except ConfigError as err:
        if launch.env_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(launch.SHARED_FAILURE_EXIT_CODE)


@hydra.main(config_path="configs", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    """Hydra's task function: :func:`run` with the composed config."""
    launch.release_stderr()
    run(cfg)


if __name__ == "__main__":
    sys.argv += launch.hydra_rank_overrides(sys.argv[1:], launch.env_rank())
    with launch.exit_at_once_on_failure(), launch.failures_reported_by_rank0():
        main()
