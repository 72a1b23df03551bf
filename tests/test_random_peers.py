"""The worked example of docs/custom-policy.md: a policy of one's own in one module and one config file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ is imported as a module, as train.py (run from the root) imports it

from examples.random_peers import RandomPeersAverager, pairing  # noqa: E402
from wagma.app.policies import known_policies, validate_policy_config  # noqa: E402
from wagma.testing import run_workers  # noqa: E402


def test_every_round_pairs_the_ranks_the_same_way_everywhere_and_rounds_differ():
    for world in (2, 5, 8):
        pairs = pairing(world, 3, seed=7)
        members = [r for pair in pairs for r in pair]
        assert len(members) == len(set(members)) == world - world % 2  # disjoint, one rank out when P is odd
        assert pairs == pairing(world, 3, seed=7)  # what every rank computes
    assert len({tuple(pairing(8, r, seed=0)) for r in range(10)}) > 1


def _rounds(rank: int, world: int) -> list[tuple[list[float], str | None]]:
    param = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    averager = RandomPeersAverager(seed=5, timeout=10.0)
    out = []
    for step in range(4):
        with torch.no_grad():
            param.add_(float(step))  # a local step
        kind = averager.average_parameters([param])
        out.append((param.detach().tolist(), kind))
    averager.close()
    return out


def test_each_pair_takes_the_mean_of_its_two_models_and_the_sum_is_kept_world4():
    out = run_workers(_rounds, 4, collective_timeout_s=10.0)
    before = [float(r + 1) for r in range(4)]
    for step in range(4):
        before = [b + step for b in before]
        after = [out[r][step][0][0] for r in range(4)]
        for a, b in pairing(4, step, seed=5):
            assert after[a] == after[b] == pytest.approx((before[a] + before[b]) / 2)
        assert sum(after) == pytest.approx(sum(before))  # pairwise means keep the sum of the models
        assert all(out[r][step][1] == "local" for r in range(4))
        before = after


def test_a_config_names_the_module_that_registers_its_policy():
    validate_policy_config({"name": "random_peers", "policy_module": "examples.random_peers"}, 4)
    assert "random_peers" in known_policies()
    with pytest.raises(ValueError, match=r"policy_module: expected a module importable from here .* 'no_such_mod'"):
        validate_policy_config({"name": "mine", "policy_module": "no_such_mod"}, 4)
    with pytest.raises(ValueError, match=r"'json' imported, but it registered no policy 'mine'"):
        validate_policy_config({"name": "mine", "policy_module": "json"}, 4)
    with pytest.raises(ValueError, match=r"expected a dotted module name .* found 'a b'"):
        validate_policy_config({"name": "mine", "policy_module": "a b"}, 4)


@pytest.mark.slow  # a real 2-rank training through train.py, about 20 s
def test_train_py_runs_the_policy_from_its_config_alone(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "averaging=candidate/random_peers",
            "nproc=2",
            "steps=20",
            "progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policy"] == "random_peers" and summary["test_accuracy"] > 0.5, summary
