"""What a training run records: per-rank JSON lines while it trains, one ``summary.json`` at the end.

All ranks write into one shared run directory: rank r appends to ``metrics_rank{r}.jsonl`` (one JSON
object per line; ``step`` first, then whatever the loop reports -- ``loss``, ``samples_per_s``,
``wait_s``, ``reductions``, ``staleness`` and any extra fields), and rank 0 writes ``summary.json``.
Files are opened in append mode so a resumed run continues the same file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["MetricsWriter", "SUMMARY_KEYS", "metrics_path", "read_metrics", "write_summary"]

SUMMARY_KEYS: tuple[str, ...] = (
    "policy", "world_size", "steps", "test_accuracy", "samples_per_s", "mean_wait_s", "global_reductions", "wall_s",
)


def metrics_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its JSON lines."""
    return Path(run_dir) / f"metrics_rank{rank}.jsonl"


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


class MetricsWriter:
    """Appends one JSON object per :meth:`write` to ``metrics_rank{rank}.jsonl`` in ``run_dir``.

    Use it as a context manager, or call :meth:`close`. Lines are flushed every ``flush_every`` writes
    and on close, so a killed run loses at most that many records.
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], rank: int, *, flush_every: int = 20, keep_through: int | None = None
    ) -> None:
        """
        Args:
            run_dir: the run directory shared by all ranks (created if missing).
            rank: this rank; names the file.
            flush_every: records between flushes to disk (at least 1).
            keep_through: when given, records of an existing file with a ``step`` above it are dropped
                first -- a run resumed from the checkpoint of step s passes s, so the steps a killed run
                did after its last checkpoint are not recorded twice; a fresh run passes 0.
        """
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
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
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, step: int, **fields: Any) -> None:
        """Append the record ``{"step": step, "rank": rank, **fields}``."""
        record = {"step": int(step), "rank": self.rank, **_jsonable(fields)}
        self._file.write(json.dumps(record) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Push buffered records to disk.

        Raises:
            RuntimeError: if the file was deleted meanwhile (the run directory removed mid-run): the
                records would go nowhere.
        """
        self._file.flush()
        self._pending = 0
        if not self._lost and os.fstat(self._file.fileno()).st_nlink == 0:
            self._lost = True  # reported once
            raise RuntimeError(
                f"the metrics file {self.path} was deleted while rank {self.rank} was writing it (was the run "
                f"directory {self.path.parent} removed?); its records are lost: keep the run directory until the "
                "run ends, and start the run again"
            )

    def close(self) -> None:
        """Flush and close the file (idempotent); raises like :meth:`flush` if the file was deleted."""
        if not self._file.closed:
            try:
                self.flush()
            finally:
                self._file.close()

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
