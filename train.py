"""Train with wagma: ``python train.py [hydra overrides]`` (4 local ranks unless ``nproc=N``).

Hydra is the parent. ``python train.py`` composes the config once, checks it (a bad one is one line and
exit status 2, before any rank starts), starts ``nproc`` local ranks through torch.distributed's elastic
launcher, each training with that config, and prints the run's summary (:mod:`wagma.app.run`).
``python train.py -m averaging=wagma,allreduce`` is a sweep: every job starts fresh ranks, and the sweep
ends with a comparison table and plots (:mod:`wagma.app.sweep`, a Hydra callback).
``python train.py --help`` lists the config groups, ``--cfg job`` prints the config.

Under torchrun (``torchrun --standalone --nproc_per_node=4 train.py [overrides]``; ``RANK`` and
``WORLD_SIZE`` set) every rank runs Hydra itself and trains in place: every rank resolves the same run
directory, only rank 0 writes Hydra's ``.hydra/`` and log file there, and a bad config is reported once,
by rank 0, with exit status 2 on every rank. Any other failure is recorded with torch.distributed.elastic's
``@record``, so torchrun's final report shows the real cause; with ``--max-restarts N`` a restarted job
resumes from its newest complete checkpoint. See :mod:`wagma.app.launch`. With ``ft=torchft`` each torchrun is one
replica group of a torchft job (``ft.lighthouse``, ``ft.first_replica``; :mod:`wagma.app.ft_torchrun`).
"""

from __future__ import annotations

import sys

from wagma.app.deps import reported_missing_dependencies

with reported_missing_dependencies("train.py"):
    import hydra
    from omegaconf import DictConfig
    from torch.distributed.elastic.multiprocessing.errors import record

    from wagma.app import launch, presets
    from wagma.app.config import ConfigError
    from wagma.app.ft_options import ft_enabled

launch.register_resolvers()


@record
def run(cfg: DictConfig) -> None:
    """Train this rank (under torchrun); end a bad config with one message and exit status 2.

    Any other exception is written to ``$TORCHELASTIC_ERROR_FILE`` (torchrun's report) and re-raised.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from wagma.app.train import train

    try:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise ConfigError(
                "-m (a sweep) under torchrun would run every job inside the same ranks; run the sweep as "
                "`python train.py -m ...`, which starts fresh ranks for each job"
            )
        if ft_enabled(cfg):  # this torchrun is one replica group of a torchft job
            from wagma.app.ft_torchrun import train_replica_group

            train_replica_group(cfg)
        else:
            train(cfg)
    except ConfigError as err:
        if launch.env_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(launch.SHARED_FAILURE_EXIT_CODE)


@hydra.main(config_path="configs", config_name="config", version_base=None)
def main(cfg: DictConfig) -> int | None:
    """Hydra's task function: train this rank under torchrun, else start the job's local ranks."""
    with reported_missing_dependencies("train.py"):
        if not launch.under_launcher():
            from wagma.app.run import run_job

            return run_job(cfg)
        launch.release_stderr()
        run(cfg)
    return None


def _refuse_dashed_launcher_flags(argv: list[str]) -> None:
    """``--nproc 4`` (the flag of the old wrapper, and of torchrun) is ``nproc=4`` here: say so in one line."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in ("--nproc", "--nproc_per_node", "--nproc-per-node", "--max-restarts", "--max_restarts"):
            key = "max_restarts" if "restarts" in flag else "nproc"
            print(f"error: train.py takes Hydra overrides: use {key}=N instead of {flag}", file=sys.stderr)
            sys.exit(2)


def _refuse_unknown_options(argv: list[str]) -> None:
    """``averaging=eager_solo`` (moved to ``reference/``) or a typo: one line naming the option to use, exit status 2.

    Hydra would print its list of options instead (:func:`wagma.app.presets.override_problems`).
    """
    problems = presets.override_problems(argv)
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        sys.exit(launch.SHARED_FAILURE_EXIT_CODE)


if __name__ == "__main__":
    _refuse_dashed_launcher_flags(sys.argv[1:])
    sys.argv += launch.hydra_rank_overrides(sys.argv[1:], launch.env_rank())
    with (
        reported_missing_dependencies("train.py"),
        launch.exit_at_once_on_failure(),
        launch.failures_reported_by_rank0(),
    ):
        _refuse_unknown_options(sys.argv[1:])
        main()
