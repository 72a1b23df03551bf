"""What a training run records: per-rank JSON lines, a CSV and TensorBoard events while it trains, one
``summary.json`` at the end.

All ranks write into one shared run directory:

- every rank r appends to ``metrics_rank{r}.jsonl`` (one JSON object per line: ``step``, ``rank``, ``time``
  -- wall-clock Unix seconds --, ``elapsed_s`` -- training seconds since the run's first step, continued
  across resumes --, then whatever the loop reports: ``loss``, ``samples_per_s``, ``wait_s``,
  ``reductions``, ``staleness``, ``test_accuracy`` and any extra fields);
- rank 0 also writes ``metrics.csv`` (the same records, the fixed columns :data:`CSV_COLUMNS`, an empty
  cell where a record lacks a field) and TensorBoard events under ``tensorboard/`` (every numeric field
  as a scalar, tagged ``train/``, ``policy/``, ``eval/`` or ``gpu/``; see :func:`tensorboard_tag`). Rank
  0's view only: the per-rank numbers of the other ranks are in their JSON lines;
- rank 0 writes ``summary.json`` at the end.

Files are opened in append mode so a resumed run continues them; records (and events) of steps after
the checkpoint a run resumes from are dropped first. Everything is flushed every ``flush_every``
records and on :meth:`MetricsWriter.close`, which the training loop calls in a ``finally`` -- a failing
run leaves complete files.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from wagma.checks import check_int, check_number, is_number

__all__ = [
    "CSV_COLUMNS",
    "SUMMARY_KEYS",
    "MetricsWriter",
    "metrics_path",
    "preload_tensorboard",
    "read_csv",
    "read_metrics",
    "tensorboard_tag",
    "write_summary",
]

log = logging.getLogger(__name__)

SUMMARY_KEYS: tuple[str, ...] = (
    "policy",
    "world_size",
    "steps",
    "test_accuracy",
    "samples_per_s",
    "mean_wait_s",
    "global_reductions",
    "staleness",
    "staleness_max",
    "startup_s",
    "train_s",
    "wall_s",
    "guard",
)

#: The columns of ``metrics.csv``, in order (fixed, so every run's CSV has the same header).
CSV_COLUMNS: tuple[str, ...] = (
    "step",
    "time",
    "elapsed_s",
    "loss",
    "samples_per_s",
    "step_s",
    "compute_s",
    "wait_s",
    "imbalance_s",
    "reductions",
    "local_reductions",
    "staleness",
    "staleness_max",
    "fresh_fraction",
    "test_accuracy",
    "test_loss",
    "consensus",
)
CSV_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"

_POLICY_FIELDS = frozenset(
    {"reductions", "local_reductions", "bytes_sent", "comm_wait_s", "staleness", "staleness_max", "fresh_fraction"}
)
_EVAL_FIELDS = frozenset({"test_accuracy", "test_loss", "consensus"})
_NOT_SCALARS = frozenset({"step", "rank", "time", "steps_in_record"})


def metrics_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its JSON lines."""
    return Path(run_dir) / f"metrics_rank{rank}.jsonl"


def tensorboard_tag(field: str) -> str:
    """The TensorBoard tag of a record field: ``eval/test_accuracy``, ``policy/staleness``, ``train/loss``, ..."""
    if field in _EVAL_FIELDS:
        return f"eval/{field}"
    if field in _POLICY_FIELDS:
        return f"policy/{field}"
    if field.startswith("gpu_"):
        return f"gpu/{field[4:]}"
    return f"train/{field}"


def _jsonable(value: Any) -> Any:
    """Plain JSON values: tensors and numpy scalars become numbers, non-finite floats become null."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _is_scalar(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def preload_tensorboard() -> None:
    """Import TensorBoard's writer now, if installed (silently otherwise: :class:`MetricsWriter` warns).

    The rank that writes events calls it before a collective of its start-up, so the import (0.2 s
    idle, seconds under load) does not delay its first step -- which the other ranks would count as
    time waited in theirs.
    """
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass


def _open_tensorboard(log_dir: Path, purge_step: int | None) -> Any:
    """A ``SummaryWriter`` on ``log_dir``, or None (after one warning line) when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning(
            "tensorboard is not installed: this run writes no TensorBoard events (its JSONL and CSV metrics are "
            "written as usual); pip install 'wagma[app]' (or tensorboard) to get them"
        )
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)


class _CsvFile:
    """``metrics.csv``: the records under the fixed header :data:`CSV_COLUMNS`, appended."""

    def __init__(self, path: Path, keep_through: int | None) -> None:
        self.path = path
        if path.exists() and (keep_through is not None or _csv_header(path) != list(CSV_COLUMNS)):
            # Drop the steps after the resumed checkpoint, and re-head a CSV written under other columns.
            kept = [r for r in read_csv(path) if keep_through is None or int(r.get("step") or 0) <= keep_through]
            tmp = path.with_suffix(".csv.tmp")
            with open(tmp, "w", encoding="utf-8", newline="") as f:
                writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, path)
        fresh = not path.exists()
        self._file = open(path, "a", encoding="utf-8", newline="")  # closed in close()
        self._writer = csv.DictWriter(self._file, CSV_COLUMNS, extrasaction="ignore")
        if fresh:
            self._writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        self._writer.writerow({k: v for k, v in record.items() if _is_scalar(v)})

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _csv_header(path: Path) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        return next(csv.reader(f), [])


class MetricsWriter:
    """Appends one JSON object per :meth:`write` to ``metrics_rank{rank}.jsonl`` in ``run_dir``, and on request
    the same record to ``metrics.csv`` and to TensorBoard events in ``tensorboard/``.

    Every record carries ``time`` (wall clock, Unix seconds) and ``elapsed_s`` (seconds since the writer
    was opened, plus ``elapsed_s`` given at construction -- a resumed run passes its checkpoint's).
    Use it as a context manager, or call :meth:`close`. Everything is flushed every ``flush_every``
    writes and on close, so a killed run loses at most that many records.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        *,
        flush_every: int = 20,
        keep_through: int | None = None,
        elapsed_s: float = 0.0,
        with_csv: bool = False,
        with_tensorboard: bool = False,
    ) -> None:
        """
        Args:
            run_dir: the run directory shared by all ranks (created if missing).
            rank: this rank; names the file.
            flush_every: records between flushes to disk (at least 1).
            keep_through: when given, records of an existing file with a ``step`` above it are dropped
                first -- a run resumed from the checkpoint of step s passes s, so the steps a killed run
                did after its last checkpoint are not recorded twice; a fresh run passes 0. TensorBoard
                discards the events after it (``purge_step``).
            elapsed_s: training seconds already done (a resumed run's), where ``elapsed_s`` starts.
            with_csv: also write ``metrics.csv`` (one rank of the run should: the train loop's rank 0).
            with_tensorboard: also write TensorBoard events (one rank should); without the tensorboard
                package this logs one warning and the run goes on.
        """
        check_int("flush_every", flush_every, minimum=1)
        check_number("elapsed_s", elapsed_s, 0)  # seconds trained before
        self.path = metrics_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through is not None and self.path.exists():
            kept = [r for r in read_metrics(run_dir, rank) if r.get("step", 0) <= keep_through]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self.rank = rank
        self._flush_every = flush_every
        self._pending = 0
        self._lost = False
        self._elapsed_base = float(elapsed_s)
        self._opened = time.perf_counter()
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        self._csv = _CsvFile(self.path.parent / CSV_NAME, keep_through) if with_csv else None
        purge = None if keep_through is None else keep_through + 1
        self._tb = _open_tensorboard(self.path.parent / TENSORBOARD_DIR, purge) if with_tensorboard else None

    @property
    def elapsed_s(self) -> float:
        """Training seconds so far: since the writer was opened, plus the ``elapsed_s`` it was given."""
        return self._elapsed_base + time.perf_counter() - self._opened

    def write(self, step: int, **fields: Any) -> None:
        """Append ``{"step": step, "rank": rank, "time": now, "elapsed_s": ..., **fields}`` (and to CSV/TensorBoard)."""
        record = {"step": int(step), "rank": self.rank, "time": time.time(), "elapsed_s": self.elapsed_s}
        record |= _jsonable(fields)
        self._file.write(json.dumps(record) + "\n")
        if self._csv is not None:
            self._csv.write(record)
        self.add_scalars(step, record, walltime=record["time"])
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def add_scalars(self, step: int, fields: Mapping[str, Any], *, walltime: float | None = None) -> None:
        """Write the numeric ``fields`` to TensorBoard only (a no-op without it), e.g. the final evaluation.

        ``step``, ``rank``, ``time`` and ``steps_in_record`` are not scalars to plot and are skipped.
        """
        if self._tb is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]  # installed: self._tb exists

        values = [
            Summary.Value(tag=tensorboard_tag(key), simple_value=float(value))
            for key, value in _jsonable(fields).items()
            if key not in _NOT_SCALARS and _is_scalar(value)
        ]
        # One event for the whole record: SummaryWriter.add_scalar makes one per value, ~15x the cost on
        # rank 0's step path (measured on the loaded 2-core machine: 2.8-3.6 ms against 0.2 ms per record of
        # 15 fields; the JSON line alone costs 0.03 ms).
        self._tb._get_file_writer().add_summary(Summary(value=values), int(step), walltime)

    def flush(self) -> None:
        """Push buffered records to disk.

        Raises:
            RuntimeError: if the file was deleted meanwhile (the run directory removed mid-run): the
                records would go nowhere.
        """
        self._file.flush()
        if self._csv is not None:
            self._csv.flush()
        if self._tb is not None:
            self._tb.flush()
        self._pending = 0
        if not self._lost and os.fstat(self._file.fileno()).st_nlink == 0:
            self._lost = True  # reported once
            raise RuntimeError(
                f"the metrics file {self.path} was deleted while rank {self.rank} was writing it (was the run "
                f"directory {self.path.parent} removed?); its records are lost: keep the run directory until the "
                "run ends, and start the run again"
            )

    def close(self) -> None:
        """Flush and close every file (idempotent); raises like :meth:`flush` if the file was deleted."""
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()
            if self._csv is not None:
                self._csv.close()
            if self._tb is not None:
                self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(run_dir: str | os.PathLike[str], rank: int) -> list[dict[str, Any]]:
    """The records rank ``rank`` wrote, in order (a last line cut short by a killed run is skipped)."""
    lines = metrics_path(run_dir, rank).read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The rows of a ``metrics.csv`` (the run directory's, or the file itself), as strings by column."""
    path = Path(path)
    if path.is_dir():
        path = path / CSV_NAME
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def write_summary(run_dir: str | os.PathLike[str], summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` (call on rank 0 only); it must hold every key of :data:`SUMMARY_KEYS`.

    The file is written to a temporary name and renamed, so readers never see half a summary.
    """
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise ValueError(f"summary lacks the keys {missing}; it must hold {list(SUMMARY_KEYS)}")
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
