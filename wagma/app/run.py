"""One command for a training run: ``python -m wagma.app.run [hydra overrides]`` (console script ``wagma-train``).

It runs ``torchrun --standalone --nproc_per_node=N train.py [overrides] hydra.run.dir=DIR`` (N = 4 unless
``--nproc`` says otherwise), so the default experiment needs no torchrun flags, then prints the run's
``summary.json`` as a short report. Overrides are Hydra's (``averaging=local_sgd steps=500
experiment=wagma_random_k``); ``hydra.run.dir=DIR`` among them picks the run directory, else it is
``outputs/<date>/<time>`` under the current directory, as with plain torchrun.

SIGTERM or SIGINT (Ctrl-C) ends the whole run: torchrun gets SIGTERM and stops its ranks; whatever is still
alive ``grace_s`` later (torchrun itself, a rank, a rank's child) is killed, so nothing is left behind. The
exit status is then 128 + the signal's number.

``train.py`` is found next to the ``wagma`` package (a checkout, or ``pip install -e .``), or where the
``WAGMA_TRAIN_SCRIPT`` environment variable points. For several nodes use torchrun (or srun) directly; see
the "training application" section of README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from wagma.app.procs import descendants, start_ticks

__all__ = [
    "DEFAULT_NPROC", "STOP_GRACE_S", "argument_parser", "default_run_dir", "format_summary", "main", "run",
    "split_run_dir", "stopping_signal", "torchrun_command", "train_script",
]

#: Ranks per run unless ``--nproc`` says otherwise: the default experiment's 4 CPU ranks.
DEFAULT_NPROC = 4
#: Seconds torchrun gets to stop its ranks after SIGTERM/SIGINT before what is left is killed.
STOP_GRACE_S = 10.0
_RUN_DIR_KEY = "hydra.run.dir="


def train_script() -> Path:
    """The Hydra entry point ``train.py``: ``$WAGMA_TRAIN_SCRIPT``, else the one beside the package.

    Raises:
        FileNotFoundError: if there is none (a non-editable install): say where it is with the variable.
    """
    path = Path(os.environ.get("WAGMA_TRAIN_SCRIPT") or Path(__file__).resolve().parents[2] / "train.py")
    if not path.is_file():
        raise FileNotFoundError(
            f"wagma's train.py was not found at {path}; run from a checkout (or `pip install -e .`), or set "
            "WAGMA_TRAIN_SCRIPT=/path/to/train.py"
        )
    return path


def default_run_dir(now: datetime.datetime | None = None, root: str | os.PathLike[str] = "outputs") -> Path:
    """``root/<YYYY-MM-DD>/<HH-MM-SS>``, the layout of train.py's own default run directory."""
    now = now or datetime.datetime.now()
    return Path(root) / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")


def split_run_dir(overrides: Sequence[str]) -> tuple[list[str], Path | None]:
    """The overrides without ``hydra.run.dir=...``, and that directory if one was given."""
    rest = [o for o in overrides if not o.startswith(_RUN_DIR_KEY)]
    given = [o[len(_RUN_DIR_KEY) :] for o in overrides if o.startswith(_RUN_DIR_KEY)]
    return rest, Path(given[-1]) if given else None


def torchrun_command(
    overrides: Sequence[str], run_dir: str | os.PathLike[str], nproc: int = DEFAULT_NPROC
) -> list[str]:
    """The torchrun command line that trains with ``overrides`` on ``nproc`` local ranks into ``run_dir``."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(train_script()), *overrides, f"{_RUN_DIR_KEY}{run_dir}",
    ]


def run(
    overrides: Sequence[str] = (),
    *,
    nproc: int = DEFAULT_NPROC,
    run_dir: str | os.PathLike[str] | None = None,
    capture: bool = False,
) -> tuple[int, dict[str, Any] | None, Path]:
    """Train once under torchrun; return ``(exit status, summary or None, run directory)``.

    Args:
        overrides: Hydra overrides for ``train.py`` (a ``hydra.run.dir=`` among them is honoured).
        nproc: ranks on this machine.
        run_dir: the run directory (default: from the overrides, else :func:`default_run_dir`).
        capture: swallow torchrun's output (for sweeps); otherwise it goes to this process's terminal.
    """
    rest, given = split_run_dir(overrides)
    directory = Path(run_dir) if run_dir is not None else given or default_run_dir()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its warning
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a stale torchrun environment would confuse the standalone rendezvous
    out = subprocess.DEVNULL if capture else None
    # A session of its own: a Ctrl-C in the terminal reaches this process only, which stops torchrun in order.
    code = _run_stoppable(
        lambda: subprocess.Popen(
            torchrun_command(rest, directory, nproc), env=env, stdout=out, stderr=out, start_new_session=True
        ),
        STOP_GRACE_S,
    )
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.is_file() else None
    return code, summary, directory


def _kill(pids: dict[int, int | None], sig: signal.Signals) -> None:
    """Send ``sig`` to each ``{pid: start ticks}`` that is still that process (a pid may be reused)."""
    for pid, ticks in pids.items():
        if start_ticks(pid) == ticks:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _run_stoppable(start: Callable[[], subprocess.Popen[bytes]], grace_s: float) -> int:
    """Start torchrun and wait for it; on SIGTERM/SIGINT stop it and its ranks, killing what is left after ``grace_s``.

    The handlers are in place before torchrun starts, so no signal can end this process and leave it behind.
    Returns torchrun's exit status, or 128 + the signal's number when a signal stopped the run.
    """
    received: list[int] = []
    started: list[subprocess.Popen[bytes]] = []
    tree: dict[int, int | None] = {}

    def stop() -> None:
        proc = started[0]
        tree.update(descendants(proc.pid))  # before torchrun ends: orphans would be hard to find
        proc.send_signal(signal.SIGTERM)  # torchrun stops its ranks (SIGTERM, then SIGKILL)

    def on_signal(signum: int, _frame: object) -> None:
        if not received:
            received.append(signum)
            if started:
                stop()

    handled = (signal.SIGTERM, signal.SIGINT)
    previous = (
        {sig: signal.signal(sig, on_signal) for sig in handled}
        if threading.current_thread() is threading.main_thread() else {}
    )
    try:
        proc = start()
        started.append(proc)
        tree[proc.pid] = start_ticks(proc.pid)
        if received:  # the signal came while torchrun was starting
            stop()
        deadline = None
        while True:
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + grace_s
                if deadline is not None and time.monotonic() > deadline:
                    tree.update(descendants(proc.pid))
                    _kill(tree, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started and proc.poll() is None:  # an exception on the way out: leave nothing running
            tree.update(descendants(proc.pid))
            _kill(tree, signal.SIGKILL)
            proc.wait()
    if received:
        _kill(tree, signal.SIGKILL)  # a rank torchrun failed to stop
        return 128 + received[0]
    return code


def stopping_signal(code: int) -> signal.Signals | None:
    """The signal (SIGTERM or SIGINT) that stopped a run, from :func:`run`'s exit status; None otherwise."""
    if code - 128 in (signal.SIGTERM, signal.SIGINT):
        return signal.Signals(code - 128)
    return None


def format_summary(summary: Mapping[str, Any]) -> str:
    """A few lines for the terminal: policy, accuracy, throughput, waiting, reductions, staleness, time."""
    wait_ms = 1e3 * float(summary.get("mean_wait_s") or 0.0)
    step_ms = 1e3 * float(summary.get("mean_step_s") or 0.0)
    lines = [
        f"policy        {summary['policy']} on {summary['world_size']} rank(s), {summary['steps']} steps "
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
    return "\n".join(lines)


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line shared by ``wagma-train`` and ``wagma-sweep``: ``--nproc``, ``--dry-run``, overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="ranks on this machine (default: 4)")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command(s) and exit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. averaging=local_sgd steps=500")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wagma.app.run [--nproc N] [--dry-run] [overrides...]``; returns torchrun's exit status."""
    parser = argument_parser("wagma-train", "Train with wagma under torchrun (default: 4 local ranks).")
    args = parser.parse_intermixed_args(argv)
    rest, given = split_run_dir(args.overrides)
    run_dir = given or default_run_dir()
    if args.dry_run:
        print(" ".join(torchrun_command(rest, run_dir, args.nproc)))
        return 0
    code, summary, directory = run(rest, nproc=args.nproc, run_dir=run_dir)
    stopped = stopping_signal(code)
    if stopped is not None:
        print(f"wagma-train: stopped by {stopped.name}; torchrun and its ranks were ended; "
              f"the newest complete checkpoint in {directory} is kept (resume=true continues from it)",
              file=sys.stderr)
        return code
    if summary is None:
        print(f"wagma-train: the run failed (exit status {code}); see the output above and {directory}",
              file=sys.stderr)
        return code or 1
    print("\n" + format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
