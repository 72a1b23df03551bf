"""Each rank's own model against the ranks' mean, on the test set, from one checkpoint of a run.

Under model averaging the ranks' models differ between global means; the final evaluation scores their mean (after
the policy's ``finalize``), evaluations during training score each rank's own model unless ``eval_model=mean``. This
reads the run's checkpoint at ``--step`` (every rank's state, saved before ``finalize``), rebuilds the run's model
and test split from its Hydra config, and scores every rank's model and the mean of them, in one process:

    python benchmarks/own_vs_mean.py RUN_DIR --step 2800 --out own_vs_mean.json

Test loss in bits per byte for a language model (else nats) and accuracy, per rank and for the mean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from omegaconf import OmegaConf  # noqa: E402

from wagma.app.config import configured_dataset, configured_model  # noqa: E402
from wagma.app.source_text import bits_per_byte  # noqa: E402
from wagma.app.step import evaluate  # noqa: E402

__all__ = ["main", "own_and_mean"]


def own_and_mean(run_dir: Path, step: int) -> dict[str, Any]:
    """Score every rank's model of ``run_dir``'s checkpoint at ``step`` and their mean, in this one process."""
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"own_vs_mean.py: expected the run's Hydra config at {config}, found none")
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    ranks = sorted(checkpoint.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    if not ranks:
        raise SystemExit(f"own_vs_mean.py: expected rank*.pt in {checkpoint}, found none")
    cfg = OmegaConf.load(config)
    dataset = configured_dataset(cfg)
    net = configured_model(cfg, dataset)
    states = [torch.load(path, map_location="cpu", weights_only=True)["model"] for path in ranks]

    def score(state: dict[str, torch.Tensor]) -> dict[str, float]:
        net.load_state_dict(state)
        accuracy, loss = evaluate(net, dataset.x_test, dataset.y_test, 0, 1)
        return {"test_loss": bits_per_byte(loss) if dataset.token_targets else loss, "test_accuracy": accuracy}

    own = [score(state) for state in states]
    mean_state = {
        key: torch.stack([s[key].float() for s in states]).mean(0).to(states[0][key].dtype)
        if states[0][key].is_floating_point()
        else states[0][key]
        for key in states[0]
    }
    unit = "bits per byte" if dataset.token_targets else "nats"
    return {"run_dir": str(run_dir), "step": step, "loss_unit": unit, "own": own, "mean": score(mean_state)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, required=True, help="the checkpoint's step (checkpoints/step_N)")
    parser.add_argument("--out", type=Path, default=None, help="write the scores here (JSON)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as store:  # evaluate() sums over the default group: a group of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
        try:
            result = own_and_mean(args.run_dir, args.step)
        finally:
            dist.destroy_process_group()
    losses = [r["test_loss"] for r in result["own"]]
    print(
        f"step {args.step}: own models {min(losses):.4f}-{max(losses):.4f} (mean of them "
        f"{sum(losses) / len(losses):.4f}), the mean model {result['mean']['test_loss']:.4f} {result['loss_unit']}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
