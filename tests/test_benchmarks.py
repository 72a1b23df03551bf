"""The policy benchmark (benchmarks/run.py): its metric definitions by hand, and a tiny quick-mode run end to end."""

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package
import wagma.app.policies as policy_module
from benchmarks import accuracy, collect, delayed_sgd, report, results_io, run
from wagma.app.policies import Policy, register_policy

REQUIRED = (
    "scenario",
    "policy",
    "status",
    "samples_per_s",
    "ideal_samples_per_s",
    "time_to_target_s",
    "final_accuracy",
    "mean_wait_s",
    "p95_wait_s",
    "global_reductions",
    "bytes_per_rank",
    "staleness_hist",
    "consensus",
)


class _PeriodicAverage(Policy):
    """A stand-in for a model-averaging policy: local SGD with a global parameter average every ``period`` steps."""

    name = "bench_test_kavg"

    def __init__(self, *, world_size: int, period: int = 4) -> None:
        self.world_size, self.period = world_size, period
        self.global_reductions, self.bytes_sent, self.since = 0, 0, 0
        self.net: nn.Module | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.net = model
        return model

    @torch.no_grad()
    def _average(self) -> None:
        assert self.net is not None
        for p in self.net.parameters():
            dist.all_reduce(p)
            p /= self.world_size
            self.bytes_sent += p.numel() * p.element_size()
        self.global_reductions += 1
        self.since = 0

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.since += 1
        if (step + 1) % self.period == 0:
            self._average()

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._average()

    def stats(self) -> dict[str, Any]:
        return {"global_reductions": self.global_reductions, "staleness": self.since, "bytes_sent": self.bytes_sent}


@pytest.fixture
def test_policy(monkeypatch: pytest.MonkeyPatch) -> str:
    """Register the stand-in policy for this test only (the registry is restored afterwards)."""
    monkeypatch.setattr(policy_module, "_POLICIES", dict(policy_module._POLICIES))

    def build(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
        return _PeriodicAverage(world_size=world_size, **options)

    def validate(options: Mapping[str, Any], world_size: int) -> None:
        pass

    register_policy(_PeriodicAverage.name, build, validate)
    return _PeriodicAverage.name


# --- definitions, by hand -------------------------------------------------------------------------------


def test_training_clock_is_the_slowest_rank_and_time_to_target_the_first_eval_at_target():
    fast = [{"step": s, "step_s": 0.1} for s in (1, 2, 3, 4)]
    slow = [
        {"step": 1, "step_s": 0.3},
        {"step": 2, "step_s": 0.1},
        {"step": 3, "step_s": 0.1},
        {"step": 4, "step_s": 0.1},
    ]
    clock = collect.training_clock([fast, slow])
    assert clock == pytest.approx({1: 0.3, 2: 0.4, 3: 0.5, 4: 0.6})
    # A record covering several steps counts each of them.
    assert collect.training_clock([[{"step": 2, "step_s": 0.5, "steps_in_record": 2}]]) == {2: 1.0}
    records = [{"step": 2, "test_accuracy": 0.8}, {"step": 3}, {"step": 4, "test_accuracy": 0.95}]
    curve = collect.accuracy_curve(records, clock, final_step=4, final_accuracy=0.97)
    assert [(p["step"], p["accuracy"]) for p in curve] == [(2, 0.8), (4, 0.95), (4, 0.97)]
    assert collect.time_to_target(curve, 0.9) == (pytest.approx(0.6), 4)
    assert collect.time_to_target(curve, 0.99) == (None, None)


def test_targets_compare_ratios_measured_side_by_side():
    def rec(scenario, policy, **kw):
        return {"scenario": scenario, "policy": policy, "status": "ok", **kw}

    records = [
        rec("random_k1", "allreduce", samples_per_s=1000.0, time_to_target_s=2.0, final_accuracy=0.96),
        rec("random_k1", "wagma", samples_per_s=1700.0, ideal_ratio=0.8, time_to_target_s=1.5, final_accuracy=0.955),
        rec("none", "allreduce", samples_per_s=2000.0),
        rec("none", "wagma", samples_per_s=1900.0),
    ]
    got = {t["target"]: (t["measured"], t["status"]) for t in report.check_targets(records)}
    assert got["random_k1: wagma samples/s / DDP"] == (pytest.approx(1.7), "met")
    assert got["random_k1: wagma samples/s / ideal"] == (0.8, "missed")
    assert got["random_k1: wagma time-to-target / DDP"] == (pytest.approx(0.75), "missed")
    assert got["random_k1: DDP final accuracy - wagma's (points)"] == (pytest.approx(0.5), "met")
    assert got["none: wagma samples/s / DDP"] == (pytest.approx(0.95), "met")
    assert got["random_k1: eager_solo samples/s / DDP"] == (None, "n/a")


def test_consensus_plot_only_when_recorded_and_with_exact_zeros(tmp_path):
    def rec(policy, values):
        points = [{"step": 10 * i, "time_s": 0.1 * i, "consensus": v} for i, v in enumerate(values, 1)]
        return {"scenario": "none", "policy": policy, "status": "ok", "consensus": points}

    assert not report.plot_consensus(tmp_path / "c.png", [rec("allreduce", [])], ["none"], ["allreduce"])
    assert not (tmp_path / "c.png").exists()
    records = [rec("allreduce", [0.0, 0.0]), rec("local_sgd", [3e-3, 1e-1])]
    assert report.plot_consensus(tmp_path / "c.png", records, ["none"], ["allreduce", "local_sgd"])
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


# --- the quick mode, tiny ------------------------------------------------------------------------------


@pytest.mark.slow  # 5-6 s: a subprocess
def test_quick_mode_writes_records_table_and_plots(tmp_path, test_policy):
    out = tmp_path / "results"
    result = run.main(
        [
            "--quick",
            "--world",
            "2",
            "--scenarios",
            "random_k1",
            "--steps",
            "16",
            "--eval-every",
            "4",
            "--target",
            "0.5",
            "--policies",
            "allreduce",
            test_policy,
            "no_such_policy",
            "--out",
            str(out),
        ]
    )
    saved = json.loads((out / "results.json").read_text())
    assert saved["records"] == json.loads(json.dumps(result["records"]))
    assert saved["command"].startswith("python ") and "--quick" in saved["command"]
    assert {"cpu_count", "platform", "torch", "git_commit"} <= set(saved["machine"])
    # No none scenario planned: a calibration run measured T, and the delay is that T.
    cal = saved["calibration"]
    assert cal["step_s"] > 0 and cal["delay_s"] == cal["step_s"] and "calibration run" in cal["source"]
    assert saved["scenarios"]["random_k1"]["imbalance"]["delay_s"] == pytest.approx(cal["step_s"], rel=1e-3)

    by_policy = {r["policy"]: r for r in saved["records"]}
    assert list(by_policy) == ["allreduce", test_policy, "no_such_policy"]
    assert all(set(REQUIRED) <= set(r) for r in saved["records"])
    skipped = by_policy["no_such_policy"]
    assert skipped["status"] == "skipped" and "no registered policy named 'no_such_policy'" in skipped["reason"]

    ddp, kavg = by_policy["allreduce"], by_policy[test_policy]
    for r in (ddp, kavg):
        assert r["status"] == "ok", r["reason"]
        assert r["samples_per_s"] > 0 and r["mean_wait_s"] >= 0 and r["p95_wait_s"] >= 0
        assert r["aggregate_samples_per_s"] >= r["samples_per_s"] * (1 - 1e-9)  # sum of rank rates >= slowest-bound
        assert 0.5 <= r["final_accuracy"] <= 1 and r["time_to_target_s"] is not None
        assert r["time_to_target_s"] <= r["accuracy_curve"][-1]["time_s"]
        # The ideal: P B / (T + k d / P) with k = 1, d = T, P = 2.
        assert r["ideal_samples_per_s"] == pytest.approx(2 * 32 / (cal["step_s"] * 1.5), rel=1e-3)
        assert r["ideal_ratio"] == pytest.approx(r["samples_per_s"] / r["ideal_samples_per_s"])
    assert ddp["global_reductions"] == 16 and ddp["ddp_ratio"] == 1.0 and ddp["bytes_per_rank"] > 0  # counted too
    assert ddp["staleness_hist"] == {"0": 32}  # 2 ranks x 16 steps, all fresh
    # Every 4 steps; the summary may or may not count finalize's average (the app counts training reductions).
    assert kavg["global_reductions"] in (16 // 4, 16 // 4 + 1)
    assert kavg["bytes_per_rank"] > 0 and kavg["ddp_ratio"] == pytest.approx(
        kavg["samples_per_s"] / ddp["samples_per_s"]
    )
    assert kavg["staleness_hist"] == {"0": 8, "1": 8, "2": 8, "3": 8}
    assert ddp["consensus"] is None or all(math.isfinite(p["consensus"]) for p in ddp["consensus"])

    assert {t["target"].split(":")[0] for t in saved["targets"]} == {"random_k1", "none"}
    table = (out / "results.md").read_text()
    assert f"| random_k1 | {test_policy} |" in table and "`no_such_policy` (skipped; random_k1)" in table
    for png in ("accuracy_vs_time.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------
# benchmarks/accuracy.py
# ----------------------------------------------------------------------------------------------


def test_accuracy_cells_take_medians_over_seeds_and_the_summary_never_passes_a_failed_run():
    def rec(world, seed, policy, acc, scenario="random_k1"):
        return {
            "dataset": "mnist",
            "model": "cnn",
            "world_size": world,
            "scenario": scenario,
            "rank_cpus": 0.0,
            "seed": seed,
            "policy": policy,
            "final_accuracy": acc,
            "samples_per_s": 100.0 * (seed + 1),
            "ddp_ratio": 1.0,
            "staleness": 0.5 if acc else None,
            "staleness_max": seed,
            "fresh_fraction": None,
        }

    records = [rec(8, s, "allreduce", a) for s, a in enumerate([0.96, 0.95, 0.97])]
    records += [rec(8, s, "a", a) for s, a in enumerate([0.90, 0.955, 0.96])]  # median 0.955: gap 0.5
    records += [rec(8, s, "b", a) for s, a in enumerate([0.97, 0.98, 0.90])]  # median 0.97: gap -1.0
    records += [rec(16, 0, "allreduce", 0.9), rec(16, 0, "a", 0.87), rec(16, 0, "b", None)]
    cells = accuracy.summarize_cells(records)
    a8 = next(c for c in cells if c["policy"] == "a" and c["world_size"] == 8)
    assert a8["median_accuracy"] == 0.955 and a8["ddp_median_accuracy"] == 0.96
    assert a8["gap_points"] == pytest.approx(0.5) and a8["seeds"] == [0, 1, 2] and a8["missing"] == []
    assert a8["cell"] == "mnist/cnn P=8 random_k1" and a8["median_samples_per_s"] == 200.0 and a8["max_staleness"] == 2
    summary = accuracy.summarize(cells, tolerance=1.0)
    assert list(summary) == ["a", "b"]  # DDP is the reference, not a row
    assert summary["a"]["max_gap_points"] == pytest.approx(3.0) and summary["a"]["where"] == "mnist/cnn P=16 random_k1"
    assert not summary["a"]["within_tolerance"]
    assert summary["b"]["missing"] == ["mnist/cnn P=16 random_k1/seed 0"] and not summary["b"]["within_tolerance"]
    assert summary["b"]["max_gap_points"] == pytest.approx(-1.0)  # better than DDP where it ran, still not a pass
    hists = [
        dict(rec(8, 0, "w", 0.9), staleness_hist={"0": 1, "1": 2}),
        dict(rec(8, 1, "w", 0.9), staleness_hist={"5": 1}),
        dict(rec(8, 0, "allreduce", 0.9), staleness_hist={"0": 9}),
    ]
    assert accuracy.staleness_distribution(hists).splitlines()[2:] == [
        "| mnist/cnn P=8 random_k1 | w | 0,1 | 25 % | 50 % | 0 % | 0 % | 25 % | 1.75 | 5 |"
    ]  # all-fresh rows left out
    # A gap of exactly the tolerance passes: 0.964 - 0.954 is 1.0000000000000009 points in floats, 1.00 on the test set.
    edge = [rec(8, 0, "allreduce", 0.964), rec(8, 0, "c", 0.954), rec(8, 0, "d", 0.953)]
    verdict = accuracy.summarize(accuracy.summarize_cells(edge), tolerance=1.0)
    assert verdict["c"]["within_tolerance"] and not verdict["d"]["within_tolerance"]
    table = accuracy.pivot(cells).splitlines()
    assert table[0] == "| policy | mnist/cnn P=8 random_k1 | mnist/cnn P=16 random_k1 |"
    assert table[2] == "| allreduce | 96.00 % | 90.00 % |" and table[3] == "| a | +0.50 / 1.00x | +3.00 / 1.00x |"
    # The guard's bound: 1.1 x the largest run-mean staleness where the policy held its accuracy, up to 0.05.
    # "a" lost its accuracy at P = 16 with runs as stale as where it held it: no staleness is validated.
    assert a8["max_run_staleness"] == 0.5 and summary["a"]["validated_staleness"] == 0.0
    assert accuracy.validated_staleness([{"gap_points": 0.2, "max_run_staleness": 1.24}], 1.0) == pytest.approx(1.4)
    assert accuracy.validated_staleness([{"gap_points": 1.5, "max_run_staleness": 1.24}], 1.0) == 0.0


def test_accuracy_at_equal_wall_time_is_each_run_at_the_first_finisher_s_training_time():
    def rec(seed, policy, curve):
        return {
            "dataset": "mnist",
            "model": "cnn",
            "world_size": 8,
            "scenario": "random_k1",
            "rank_cpus": 0.0,
            "seed": seed,
            "policy": policy,
            "final_accuracy": curve[-1][1],
            "samples_per_s": 1.0,
            "ddp_ratio": 1.0,
            "staleness": None,
            "staleness_max": None,
            "fresh_fraction": None,
            "accuracy_curve": [{"step": 100 * (i + 1), "time_s": t, "accuracy": a} for i, (t, a) in enumerate(curve)],
        }

    records = [
        rec(0, "allreduce", [(10.0, 0.90), (20.0, 0.96)]),  # slow: 20 s for the whole run
        rec(0, "fast", [(4.0, 0.85), (8.0, 0.93)]),  # first to finish: the equal time is 8 s
        rec(0, "late", [(9.0, 0.80), (18.0, 0.95)]),  # no evaluation by 8 s
        rec(1, "allreduce", [(5.0, 0.91), (12.0, 0.95)]),
        rec(1, "fast", [(6.0, 0.94)]),
    ]
    assert accuracy.accuracy_at(records[0]["accuracy_curve"], 10.0) == 0.90
    assert accuracy.accuracy_at(records[0]["accuracy_curve"], 9.99) is None and accuracy.accuracy_at(None, 5.0) is None
    cells = accuracy.summarize_cells(records)
    by = {c["policy"]: c for c in cells}
    assert [r["equal_time_accuracy"] for r in records] == [None, 0.93, None, 0.91, 0.94]
    assert [r["equal_time_s"] for r in records] == [8.0, 8.0, 8.0, 6.0, 6.0]
    assert by["fast"]["median_equal_time_accuracy"] == pytest.approx(0.935)  # seeds 0 and 1
    assert by["allreduce"]["median_equal_time_accuracy"] == 0.91  # seed 0 had no evaluation by then
    assert by["fast"]["equal_time_gap_points"] == pytest.approx(-2.5) and by["late"]["equal_time_gap_points"] is None
    assert by["fast"]["median_accuracy"] == pytest.approx(0.935)  # the final accuracies are untouched


#: The only cells of the committed grid a shipped preset may leave out, and who may. These presets average with
#: blocking collectives only, so their model sequence does not depend on when ranks arrive: in a cell that differs
#: from another only in its delays or quota they train the same model, only slower or faster (shown bit for bit by
#: tests/test_averaging.py's test_blocking_averagers_train_the_same_model_whatever_the_delays_world4). Their gap
#: there is the gap of the same workload, world and seed in a cell they ran. The check below also holds the claim
#: against the records: one code (commit) gives one accuracy per workload, world and seed, whatever the scenario.
DELAY_INDEPENDENT = ("local_sgd", "hierarchical", "hierarchical_momentum")
SKIPPED_CELLS = ("mnist/cnn P=16 persistent quota 0.125", "mnist/cnn P=16 random_k2 quota 0.125")


def _grid(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    saved = results_io.load(path)
    cells = accuracy.summarize_cells(saved["records"])
    return saved, cells, accuracy.summarize(cells, saved["settings"]["tolerance"])


def _absent_cells_allowed(preset: str, absent: list[str], records: list[dict[str, Any]]) -> list[str]:
    """What is wrong with ``preset`` leaving ``absent`` out of the grid ([] when nothing is)."""
    if not absent:
        return []
    if preset not in DELAY_INDEPENDENT:
        return [f"{preset} never ran {absent}, and only {DELAY_INDEPENDENT} may skip cells"]
    errors = [f"{preset} skipped {cell}, not one of {SKIPPED_CELLS}" for cell in absent if cell not in SKIPPED_CELLS]
    mine = [r for r in records if r["policy"] == preset]
    by_run = {(r["dataset"], r["model"], r["world_size"], r["seed"]) for r in mine}
    by_code: dict[tuple[Any, ...], set[Any]] = {}
    for r in mine:
        if r.get("commit"):  # a record without its commit cannot say which code it ran
            key = (r["dataset"], r["model"], r["world_size"], r["seed"], r["commit"])
            by_code.setdefault(key, set()).add(r["final_accuracy"])
    errors += [
        f"{preset} is not delay-independent: {key} gave {sorted(accs)} across scenarios"
        for key, accs in by_code.items()
        if len(accs) != 1
    ]
    for cell in absent:
        ddp = [
            r for r in records if r["policy"] == accuracy.BASELINE and accuracy._cell_name(accuracy.cell_key(r)) == cell
        ]
        for r in ddp:  # the same workload, world and seed must have run elsewhere, so the cell's gap is known
            if (r["dataset"], r["model"], r["world_size"], r["seed"]) not in by_run:
                errors.append(f"{preset} skipped {cell} seed {r['seed']} and ran its workload and world nowhere else")
    return errors


def test_every_shipped_preset_held_its_accuracy_in_every_cell_of_the_committed_grid_and_carries_its_bound():
    # A preset ships only with the evidence. Every configs/averaging/*.yaml (not reference/, not a
    # `baseline: true` one) ran every cell of the committed grid with every seed DDP ran there, within tolerance of
    # allreduce in each (a delay-independent preset may skip the cells named above, nothing else), and its
    # validated_staleness (the guard's bound) is the one the grid gives; a preset without staleness has none.
    # A preset validated after the grid was run has its own grid, benchmarks/results/accuracy/<preset>/, with DDP
    # in each of its invocations; it must cover every cell of the committed grid.
    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[1]
    results = root / "benchmarks/results/accuracy"
    saved, cells, grid_summary = _grid(results / "accuracy.json.xz")
    grid_cells = {c["cell"] for c in cells if c["policy"] == accuracy.BASELINE}
    shipped = []
    for path in sorted((root / "configs/averaging").glob("*.yaml")):
        preset = path.stem
        if preset == "allreduce" or "\nbaseline: true" in path.read_text():
            continue  # the gossip baselines ship to be compared against, as published
        shipped.append(preset)
        summary, records = grid_summary, saved["records"]
        if preset not in grid_summary:
            own = results / preset / "accuracy.json.xz"
            assert own.is_file(), f"{preset} is shipped but in neither the committed grid nor {own}"
            own_saved, own_cells, summary = _grid(own)
            records = own_saved["records"]
            ran = {c["cell"] for c in own_cells if c["policy"] == accuracy.BASELINE}
            assert grid_cells <= ran, f"{preset}'s grid lacks cells of the committed one: {grid_cells - ran}"
            assert preset in summary, f"{preset} is not in its own grid {own}"
        v = summary[preset]
        assert not v["missing"], f"{preset}: failed or seeds not run: {v['missing']}"
        wrong = _absent_cells_allowed(preset, v["absent"], records)
        assert not wrong, wrong
        assert v["max_gap_points"] is not None and v["max_gap_points"] <= saved["settings"]["tolerance"], (preset, v)
        with initialize_config_dir(config_dir=str(root / "configs"), version_base=None):
            declared = compose("config", overrides=[f"averaging={preset}"]).averaging.get("validated_staleness")
        assert declared == v["validated_staleness"], (preset, declared, v)
    assert set(DELAY_INDEPENDENT) <= set(shipped), "a preset allowed to skip cells is no longer shipped"


def test_every_reference_preset_carries_the_staleness_bound_of_its_own_grid():
    # A reference preset's validated_staleness (the guard's bound) comes from the grid that measured it: the
    # committed grid, or for a preset only the earlier grid at the same settings ran, that one. Never borrowed.
    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[1]
    results = root / "benchmarks/results/accuracy"
    grids = [_grid(results / "accuracy.json.xz")[2], _grid(results / "before_issue28/accuracy.json.xz")[2]]
    presets = sorted((root / "configs/averaging/reference").glob("*.yaml"))
    assert presets
    for path in presets:
        summary = next((g[path.stem] for g in grids if path.stem in g), None)
        assert summary is not None, f"reference/{path.stem} is in no grid of {results}"
        with initialize_config_dir(config_dir=str(root / "configs"), version_base=None):
            averaging = compose("config", overrides=[f"averaging=reference/{path.stem}"]).averaging
        assert averaging.get("validated_staleness") == summary["validated_staleness"], (path.stem, summary)


def test_the_staleness_bound_stays_below_any_staleness_a_preset_lost_accuracy_at():
    def cell(gap: float, lo: float, hi: float) -> dict[str, float]:
        return {"gap_points": gap, "min_run_staleness": lo, "max_run_staleness": hi}

    assert accuracy.validated_staleness([cell(0.2, 1.0, 1.24)], 1.0) == pytest.approx(1.4)  # held only: 1.1 x, up
    assert accuracy.validated_staleness([cell(1.7, 2.18, 2.32)], 1.0) == 0.0  # lost only: nothing validated
    assert accuracy.validated_staleness([cell(0.5, 1.0, 1.8), cell(1.5, 1.93, 1.95)], 1.0) == pytest.approx(1.9)
    assert accuracy.validated_staleness([cell(0.5, 1.0, 1.2), cell(1.5, 2.5, 3.0)], 1.0) == pytest.approx(1.35)
    assert accuracy.validated_staleness([cell(0.5, 1.0, 1.2), cell(1.5, 0.8, 0.9)], 1.0) == 0.0
    assert accuracy.validated_staleness([{"gap_points": 0.1, "max_run_staleness": None}], 1.0) is None


def test_the_grid_check_refuses_a_skipped_cell_a_missing_seed_and_a_delay_dependent_skipper():
    def rec(scenario: str, seed: int, policy: str, acc: float) -> dict[str, Any]:
        return {
            "dataset": "mnist",
            "model": "cnn",
            "world_size": 16,
            "scenario": scenario,
            "rank_cpus": 0.125,
            "seed": seed,
            "policy": policy,
            "final_accuracy": acc,
            "samples_per_s": 1.0,
            "ddp_ratio": 1.0,
            "staleness": None,
            "staleness_max": None,
            "fresh_fraction": None,
        }

    ddp = [rec(s, seed, "allreduce", 0.96) for s in ("random_k1", "persistent") for seed in (0, 1)]
    same = [rec("random_k1", seed, "local_sgd", 0.955) for seed in (0, 1)]
    summary = accuracy.summarize(accuracy.summarize_cells(ddp + same), 1.0)["local_sgd"]
    assert summary["absent"] == ["mnist/cnn P=16 persistent quota 0.125"] and not summary["within_tolerance"]
    assert _absent_cells_allowed("local_sgd", summary["absent"], ddp + same) == []  # declared, and it holds
    assert _absent_cells_allowed("wagma", summary["absent"], ddp + same)  # wagma's rounds depend on the delays
    differs = [dict(r, commit="abc") for r in same + [rec("heavy_tail", 0, "local_sgd", 0.94)]]
    assert any("not delay-independent" in e for e in _absent_cells_allowed("local_sgd", summary["absent"], differs))
    one_seed = accuracy.summarize(accuracy.summarize_cells(ddp + same[:1]), 1.0)["local_sgd"]
    assert one_seed["missing"] == ["mnist/cnn P=16 random_k1 quota 0.125/seed 1 (not run)"]
    assert not one_seed["within_tolerance"]


@pytest.mark.slow  # real 2-rank trainings, 7.5 s
def test_accuracy_grid_sets_each_policy_beside_ddp_at_equal_samples_and_resumes(tmp_path, test_policy):
    argv = [
        "--workloads",
        "digits:mlp",
        "--worlds",
        "2",
        "--scenarios",
        "random_k1",
        "--seeds",
        "0",
        "--steps",
        "12",
        "--delay-s",
        "0.005",
        "--eval-every",
        "0",
        "--policies",
        test_policy,
        "no_such_policy",
        "--out",
        str(tmp_path / "acc"),
        "--work",
        str(tmp_path / "work"),
        "--allow-dirty",
    ]
    out = accuracy.main(argv)
    saved = results_io.load(tmp_path / "acc" / "accuracy.json.xz")
    assert saved["records"] == json.loads(json.dumps(out["records"]))
    by_policy = {r["policy"]: r for r in saved["records"]}
    assert list(by_policy) == ["allreduce", test_policy, "no_such_policy"]
    ddp, mine = by_policy["allreduce"]["final_accuracy"], by_policy[test_policy]["final_accuracy"]
    assert 0 < ddp <= 1 and 0 < mine <= 1
    assert by_policy[test_policy]["gap_points"] == pytest.approx(100 * (ddp - mine))
    assert by_policy["no_such_policy"]["final_accuracy"] is None
    assert saved["summary"]["no_such_policy"]["missing"] == ["digits/mlp P=2 random_k1/seed 0"]
    assert len(saved["invocations"]) == 1 and "--eval-every 0" in saved["invocations"][0]
    table = (tmp_path / "acc" / "accuracy.md").read_text()
    assert f"| digits/mlp P=2 random_k1 | {test_policy} | 0 |" in table and "no_such_policy: no accuracy" in table
    again = accuracy.main([*argv, "--resume", "--seeds", "0", "1"])  # seed 0 is kept, only seed 1 runs
    assert len(again["invocations"]) == 2 and again["records"][:3] == saved["records"]
    assert sorted({r["seed"] for r in again["records"]}) == [0, 1] and len(again["commands"]) == 2
    assert all(r["commit"] for r in again["records"] if r["policy"] == "allreduce")
    report = accuracy.main(["--report-only", "--out", str(tmp_path / "acc")])  # runs nothing, keeps the settings
    assert report["records"] == json.loads(json.dumps(again["records"])) and report["commands"] == again["commands"]
    assert report["settings"]["steps"] == 12


# ----------------------------------------------------------------------------------------------
# benchmarks/delayed_sgd.py
# ----------------------------------------------------------------------------------------------


def test_delayed_heavy_ball_stability_matches_the_closed_forms():
    for mu in (0.0, 0.5, 0.9):
        assert delayed_sgd.max_stable_step(mu, 0) == pytest.approx(2 * (1 + mu), rel=1e-6)  # synchronous heavy ball
    assert delayed_sgd.max_stable_step(0.0, 1) == pytest.approx(1.0, rel=1e-6)  # x' = x - eh x_{t-1}: eh < 1
    assert delayed_sgd.max_stable_step(0.9, 1) == pytest.approx(0.1, rel=1e-4)  # one step late: 38x less room
    assert delayed_sgd.max_stable_step(0.9, 1, fresh=1.0) == pytest.approx(3.8, rel=1e-6)


def test_delayed_sgd_emulation_runs_and_staleness_is_parsed():
    assert delayed_sgd.parse_staleness("0:0.2,1:0.8") == {0: 0.2, 1: 0.8}
    with pytest.raises(ValueError, match="ROUNDS:PROBABILITY"):
        delayed_sgd.parse_staleness("1")
    sync = delayed_sgd.emulate({0: 1.0}, dataset="digits", model="mlp", ranks=4, steps=40, lr=0.5)
    late = delayed_sgd.emulate({1: 1.0}, dataset="digits", model="mlp", ranks=4, steps=40, lr=0.5)
    assert sync > 0.85 and late < 0.3  # at a learning rate sync SGD takes (93 %), one step of delay does not learn


def test_delayed_sgd_remedies_follow_their_rules():
    # Mitliagkas et al.: a queue of s + 1 workers adds s / (s + 1) of momentum; the explicit one is lowered by it.
    assert delayed_sgd.lowered_momentum(0.9, {1: 1.0}) == pytest.approx(0.4)
    assert delayed_sgd.lowered_momentum(0.9, {0: 0.2, 1: 0.8}) == pytest.approx(0.9 - 0.8 / 1.8)
    assert delayed_sgd.lowered_momentum(0.5, {3: 1.0}) == 0.0  # never below 0
    kw = dict(dataset="digits", model="mlp", ranks=4, steps=40, lr=0.5)
    late = delayed_sgd.emulate({1: 1.0}, **kw)
    assert delayed_sgd.emulate({1: 1.0}, remedy="staleness_lr", **kw) == late  # lr / s is lr at s = 1
    assert delayed_sgd.emulate({0: 1.0}, remedy="lookahead", **kw) == delayed_sgd.emulate({0: 1.0}, **kw)  # s = 0
    assert delayed_sgd.emulate({1: 1.0}, remedy="outside", **kw) > late + 0.3  # plain SGD for late gradients learns
    with pytest.raises(ValueError, match="remedy: expected one of"):
        delayed_sgd.emulate({1: 1.0}, remedy="drop", **kw)
    # lookahead_own: c_s steps of the own gradient, where SGD carries the model if every step in flight applies it
    own = delayed_sgd.emulate({1: 1.0}, remedy="lookahead_own", **kw)
    assert delayed_sgd.emulate({1: 1.0}, remedy="lookahead_own", cover=1, **kw) == own  # cover = age: the same point
    assert delayed_sgd.emulate({1: 1.0}, remedy="lookahead_own", cover=2, **kw) != own  # a point two steps ahead
    with pytest.raises(ValueError, match="cover: expected None or an integer >= 1"):
        delayed_sgd.emulate({1: 1.0}, remedy="lookahead_own", cover=0, **kw)


# ----------------------------------------------------------------------------------------------
# benchmarks/engine_latency.py (also the engine section of benchmarks/gpu.py)
# ----------------------------------------------------------------------------------------------
def test_engine_latency_measures_on_cpu_ranks():
    from benchmarks import engine_latency

    result = engine_latency.measure(world=4, group=2, rounds=8, numel=16, sync_period=3)
    assert result["device"] == "cpu" and result["world_size"] == 4 and result["rounds"] == 8
    assert result["median_round_ms"] > 0 and result["median_async_round_ms"] > 0
    assert result["median_activation_latency_ms"] is not None  # one winner per async round, others timed


def test_engine_latency_refuses_bad_input_and_cuda_without_a_gpu():
    from benchmarks import engine_latency

    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        engine_latency.measure(device="tpu")
    with pytest.raises(ValueError, match="rounds >= 2"):
        engine_latency.measure(rounds=1)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            engine_latency.measure(world=2, rounds=4, device="cuda")


def test_time_to_solution_counts_runs_that_never_got_there_as_slowest():
    def rec(seed, policy, curve, world=4):
        return {
            "dataset": "sequences",
            "model": "transformer",
            "world_size": world,
            "scenario": "none",
            "rank_cpus": 0.25,
            "seed": seed,
            "policy": policy,
            "final_accuracy": curve[-1][1],
            "samples_per_s": 1.0,
            "ddp_ratio": 1.0,
            "staleness": None,
            "staleness_max": None,
            "fresh_fraction": None,
            "accuracy_curve": [{"step": 10 * (i + 1), "time_s": t, "accuracy": a} for i, (t, a) in enumerate(curve)],
        }

    records = [
        rec(0, "allreduce", [(10.0, 0.7), (20.0, 0.85)]),
        rec(1, "allreduce", [(12.0, 0.81), (24.0, 0.86)]),
        rec(2, "allreduce", [(11.0, 0.6), (22.0, 0.79)]),  # never reaches 0.8
        rec(0, "fast", [(5.0, 0.82)]),
        rec(1, "fast", [(6.0, 0.7), (12.0, 0.84)]),
        rec(2, "fast", [(4.0, 0.81)]),
        rec(0, "poor", [(5.0, 0.5)]),
        rec(1, "poor", [(5.0, 0.5)]),
        rec(2, "poor", [(3.0, 0.9)]),
    ]
    cells = {c["policy"]: c for c in accuracy.summarize_cells(records, target=0.8, batch_size=16)}
    # Samples: step x P x batch where the curve does not count them.
    assert records[0]["time_to_target_s"] == 20.0 and records[0]["samples_to_target"] == 20 * 4 * 16
    assert cells["allreduce"]["reached"] == 2 and cells["allreduce"]["median_time_to_target_s"] == 20.0  # 12, 20, never
    assert cells["fast"]["median_time_to_target_s"] == 5.0 and cells["fast"]["time_to_target_x_ddp"] == 5.0 / 20.0
    assert cells["poor"]["reached"] == 1 and cells["poor"]["median_time_to_target_s"] is None  # 2 of 3 never did
    assert cells["poor"]["time_to_target_x_ddp"] is None
    # A curve that counts its samples (batches by tokens) is read as it counts them.
    assert accuracy.to_target([{"step": 3, "time_s": 1.0, "accuracy": 0.9, "samples": 123.0}], 0.8, 4, 16) == (
        1.0,
        123.0,
    )
    assert accuracy.to_target(None, 0.8, 4, 16) == (None, None)


def test_samples_clock_and_compute_spread_from_per_step_records():
    a = [
        {"step": s, "step_s": 0.1, "samples": n, "compute_s": c} for s, n, c in [(1, 3, 1.0), (2, 5, 1.0), (3, 4, 1.0)]
    ]
    b = [
        {"step": s, "step_s": 0.1, "samples": n, "compute_s": c} for s, n, c in [(1, 2, 1.0), (2, 2, 3.0), (3, 1, 2.0)]
    ]
    c = [{"step": s, "step_s": 0.1, "samples": 1, "compute_s": 1.0} for s in (1, 2, 3)]
    assert collect.samples_clock([a, b]) == {1: 5.0, 2: 12.0, 3: 17.0}
    assert collect.samples_clock([a, [{"step": 1, "step_s": 0.1}]]) == {}  # records without counts: no clock
    spread = collect.compute_spread([a, b, c], warmup=1)  # steps 2 and 3: max/median 3/1 and 2/1
    assert spread["compute_max_over_median"] == pytest.approx(2.5)
    values = np.array([1.0, 3.0, 1.0, 1.0, 2.0, 1.0])
    assert spread["compute_cv"] == pytest.approx(values.std() / values.mean())
    assert collect.compute_spread([a], warmup=5) == {"compute_max_over_median": None, "compute_cv": None}


@pytest.mark.slow
def test_hsdp_benchmark_writes_step_rates_accuracy_and_memory(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "hsdp.py"),
            "--quick",
            "--steps",
            "12",
            "--compute-ms",
            "5",
            "--policies",
            "hsdp",
            "hsdp_wagma",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "hsdp.json").read_text())
    assert [r["policy"] for r in result["runs"]] == ["hsdp", "hsdp_wagma"]
    assert result["summary"]["hsdp"]["x_hsdp"] == 1.0 and result["summary"]["hsdp_wagma"]["step_ms"] > 0
    assert 0.0 <= result["summary"]["hsdp_wagma"]["accuracy"] <= 1.0
    assert set(result["memory"]) >= {"ddp", "fsdp_shard_only", "hsdp_wagma"} and result["memory"]["width"] == 512


@pytest.mark.slow
def test_wire_benchmark_sets_bf16_beside_float32_with_half_the_bytes(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "wire.py"),
            "--workloads",
            "digits:mlp",
            "--world",
            "2",
            "--seeds",
            "0",
            "--steps",
            "20",
            "--policies",
            "wagma",
            "--out",
            str(tmp_path / "out"),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from benchmarks.results_io import load

    rows = {r["policy"]: r for r in load(tmp_path / "out" / "wire.json.xz")["comparison"]}
    assert set(rows) == {"allreduce", "wagma"}
    for row in rows.values():
        assert row["bytes_ratio"] == pytest.approx(0.5, abs=0.01)  # bf16: half of float32's bytes
        assert 0.0 <= row["accuracy_bf16"] <= 100.0 and "gap_points" in row
    assert "| digits:mlp | wagma |" in (tmp_path / "out" / "wire.md").read_text()


def test_a_policy_name_finds_its_config_in_the_shipped_reference_or_candidate_folder(tmp_path):
    from benchmarks.presets import averaging_option

    configs = Path(__file__).resolve().parents[1] / "configs"
    assert averaging_option("wagma", configs) == "wagma"
    assert averaging_option("eager_solo", configs) == "reference/eager_solo"
    assert averaging_option("no_such_policy", configs) == "no_such_policy"  # resolve_policy reports it as skipped
    (tmp_path / "averaging" / "candidate").mkdir(parents=True)
    (tmp_path / "averaging" / "candidate" / "trial.yaml").write_text("name: wagma\n")
    assert averaging_option("trial", tmp_path) == "candidate/trial"
    (tmp_path / "averaging" / "reference").mkdir(parents=True)
    for folder in ("reference", "candidate"):
        (tmp_path / "averaging" / folder / "twice.yaml").write_text("name: wagma\n")
    with pytest.raises(ValueError, match=r"policy 'twice' is ambiguous: .* found it in reference, candidate"):
        averaging_option("twice", tmp_path)


def test_a_capped_run_gets_a_cfs_period_a_step_more_before_it_is_killed_as_hung():
    # The grid's settings: 400 steps, d = T = 20 ms, random_k1 (max delay d). Without a quota: 224 s, which
    # allreduce at P = 16 with rank_cpus=0.125 overran in all three seeds of a cell.
    assert run.run_timeout_s(400, 0.02, 0.02) == pytest.approx(224.0)
    assert run.run_timeout_s(400, 0.02, 0.02, rank_cpus=0.125) == pytest.approx(224.0 + 400 * 0.4)
    assert run.run_timeout_s(400, 0.02, 0.02, rank_cpus=0.0) == run.run_timeout_s(400, 0.02, 0.02)


def test_a_resumed_grid_retries_the_invocations_in_which_a_run_failed(tmp_path, monkeypatch):
    calls = []

    def fake_run(argv):  # DDP fails in seed 0's first invocation only
        seed = int(argv[argv.index("--seed") + 1])
        ddp_failed = seed == 0 and not any(c == 0 for c in calls)
        calls.append(seed)
        ddp = (
            {"scenario": "random_k1", "policy": "allreduce", "status": "failed", "reason": "WorkerError: killed"}
            if ddp_failed
            else {
                "scenario": "random_k1",
                "policy": "allreduce",
                "status": "ok",
                "final_accuracy": 0.9,
                "samples_per_s": 100.0,
                "ddp_ratio": 1.0,
            }
        )
        mine = {
            "scenario": "random_k1",
            "policy": "wagma",
            "status": "ok",
            "final_accuracy": 0.8,
            "samples_per_s": 120.0,
            "ddp_ratio": 1.2,
        }
        return {"records": [ddp, mine]}

    monkeypatch.setattr(accuracy.run, "main", fake_run)
    argv = [
        "--workloads",
        "digits:mlp",
        "--worlds",
        "2",
        "--scenarios",
        "random_k1",
        "--seeds",
        "0",
        "1",
        "--policies",
        "wagma",
        "--out",
        str(tmp_path / "acc"),
        "--work",
        str(tmp_path / "work"),
        "--allow-dirty",
    ]
    first = accuracy.main(argv)
    assert [r["status"] for r in first["records"] if r["seed"] == 0] == ["failed", "ok"]
    assert accuracy.main([*argv, "--resume"])["records"] == first["records"] and calls == [0, 1]  # nothing reruns
    again = accuracy.main([*argv, "--resume", "--retry-failed"])
    assert calls == [0, 1, 0]  # only the invocation with the failure
    assert len(again["invocations"]) == 2  # the retried one is listed once
    assert sorted((r["seed"], r["policy"], r["status"]) for r in again["records"]) == [
        (0, "allreduce", "ok"),
        (0, "wagma", "ok"),
        (1, "allreduce", "ok"),
        (1, "wagma", "ok"),
    ]
    assert next(r for r in again["records"] if r["seed"] == 0 and r["policy"] == "wagma")[
        "gap_points"
    ] == pytest.approx(10)
    del first["records"][0]["status"]  # records written before they kept a status: DDP without accuracy failed
    assert accuracy._failed(first["records"][0]) and not accuracy._failed(first["records"][1])
    with pytest.raises(SystemExit):
        accuracy.parse_args([*argv, "--retry-failed"])  # without --resume there is nothing to retry


def test_the_grid_refuses_uncommitted_code_and_its_records_name_their_commit(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(
        accuracy.run,
        "main",
        lambda argv: (
            calls.append(argv)
            or {"records": [{"scenario": "random_k1", "policy": "allreduce", "status": "ok", "final_accuracy": 0.9}]}
        ),
    )
    argv = [
        "--workloads",
        "digits:mlp",
        "--worlds",
        "2",
        "--scenarios",
        "random_k1",
        "--seeds",
        "0",
        "--policies",
        "allreduce",
        "--out",
        str(tmp_path / "acc"),
        "--work",
        str(tmp_path / "work"),
    ]
    monkeypatch.setattr(accuracy, "machine_info", lambda root: {"git_commit": "abc123+dirty"})
    with pytest.raises(SystemExit, match=r"expected a checkout whose code is committed, found abc123\+dirty"):
        accuracy.main(argv)
    assert calls == []  # refused before any run
    assert accuracy.main([*argv, "--allow-dirty"])["records"][0]["commit"] == "abc123+dirty"  # said, if allowed
    monkeypatch.setattr(accuracy, "machine_info", lambda root: {"git_commit": "abc123"})
    assert accuracy.main(argv)["records"][0]["commit"] == "abc123"
    assert accuracy.main(["--report-only", "--out", str(tmp_path / "acc")])  # a report runs nothing: always allowed


def test_results_written_into_the_tree_do_not_make_its_code_dirty(tmp_path):
    import subprocess

    from benchmarks.machine import RESULTS, git_commit

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / RESULTS).mkdir(parents=True)
    (tmp_path / RESULTS / "grid.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    clean = git_commit(tmp_path)
    assert clean and not clean.endswith("+dirty")
    (tmp_path / RESULTS / "grid.json").write_text('{"records": []}')  # a benchmark wrote its results
    assert git_commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")  # the code changed
    assert git_commit(tmp_path) == clean + "+dirty"


# --- the guard's verdict and the loss curve travel with every record ---------------------------------------------


def _fake_run_outputs(
    run_dir: Path, world: int, steps: int, *, guard: Any = "absent", log_every: int = 1
) -> list[float]:
    """What a finished training run leaves in ``run_dir`` (metrics of every rank, rank 0's summary); rank 0's losses."""
    run_dir.mkdir(parents=True, exist_ok=True)
    losses = [2.3 * math.exp(-s / 50) + 0.1 for s in range(1, steps + 1)]
    for rank in range(world):
        lines = [
            json.dumps(
                {
                    "step": s,
                    "rank": rank,
                    "loss": losses[s - 1] + rank,
                    "step_s": 0.01,
                    "compute_s": 0.008,
                    "wait_s": 0.002,
                    "samples": 32,
                    "steps_in_record": log_every,
                }
            )
            for s in range(log_every, steps + 1, log_every)
        ]
        (run_dir / f"metrics_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"steps": steps, "batch_size": 32, "test_accuracy": 0.81, "samples_per_s": 1000.0, "mean_wait_s": 0.002}
    if guard != "absent":
        summary["guard"] = guard
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return losses


def test_a_runs_record_carries_the_guards_verdict_and_rank_0s_loss_curve_kept_small(tmp_path):
    flagged = {
        "ok": False,
        "warnings": [
            "wagma_relaxed_overlap is not learning: the training loss rose back to 1.9 "
            "and stayed there for 100 steps; staleness 1.80 rounds; try averaging=wagma"
        ],
    }
    losses = _fake_run_outputs(tmp_path / "a", 2, 400, guard=flagged)
    got = run.guard_and_loss_curve(tmp_path / "a")
    assert got["guard"] == flagged  # summary.json's entry as it is: the flag and its line
    curve = got["loss_curve"]
    assert len(curve) == run.LOSS_CURVE_POINTS == 100
    assert curve[0] == [1, losses[0]] and curve[-1] == [400, losses[-1]]  # rank 0's, first and last step kept
    assert all(loss == losses[step - 1] for step, loss in curve)
    gaps = {b[0] - a[0] for a, b in zip(curve, curve[1:])}
    assert gaps <= {4, 5} and len(curve) == len({step for step, _ in curve})  # evenly spread, no step twice
    # A short run keeps every record it has, at the metrics' own granularity (log_every 5 here).
    _fake_run_outputs(tmp_path / "b", 2, 200, guard={"ok": True, "warnings": []}, log_every=5)
    got = run.guard_and_loss_curve(tmp_path / "b")
    assert got["guard"] == {"ok": True, "warnings": []}
    assert [step for step, _ in got["loss_curve"]] == list(range(5, 201, 5))
    # A summary written before the guard existed: no verdict, not a clean one.
    _fake_run_outputs(tmp_path / "c", 2, 20)
    assert run.guard_and_loss_curve(tmp_path / "c")["guard"] is None


def test_run_py_records_and_the_accuracy_grid_keep_the_guard_and_loss_curve(tmp_path, monkeypatch):
    import argparse

    from omegaconf import OmegaConf

    flagged = {
        "ok": False,
        "warnings": [
            "eager_solo_overlap is not learning: the final test accuracy 10.00 % is at "
            "chance level (10 % for 10 classes) after 400 steps; staleness 1.00 rounds"
        ],
    }
    monkeypatch.setattr(
        run,
        "_train",
        lambda cfg, run_dir, world, timeout_s, every: _fake_run_outputs(run_dir, world, 60, guard=flagged),
    )
    cfg = OmegaConf.create({"averaging": {"name": "wagma", "validated_staleness": 2.5}, "rank_cpus": 0})
    args = argparse.Namespace(out=tmp_path, steps=60, world=2, target=0.9, consensus_every=0)
    rec = run._run_one(cfg, "random_k1", "wagma", args, 0.0, 0.01)
    assert rec["status"] == "ok", rec["reason"]
    assert rec["guard"] == flagged and [p[0] for p in rec["loss_curve"]] == list(range(1, 61))

    def failing(*_: Any) -> None:
        raise OSError("no space left")

    monkeypatch.setattr(run, "_train", failing)
    failed = run._run_one(cfg, "random_k1", "wagma", args, 0.0, 0.01)
    assert failed["status"] == "failed" and failed["guard"] is None and failed["loss_curve"] is None

    curve = [[10, 2.0], [20, 1.5]]

    def fake_run(argv: list[str]) -> dict[str, Any]:
        base = {"scenario": "random_k1", "status": "ok", "final_accuracy": 0.9, "samples_per_s": 1.0, "ddp_ratio": 1.0}
        return {
            "records": [
                base | {"policy": "allreduce", "guard": {"ok": True, "warnings": []}, "loss_curve": curve},
                base | {"policy": "wagma", "guard": flagged, "loss_curve": curve[:1]},
            ]
        }

    monkeypatch.setattr(accuracy.run, "main", fake_run)
    monkeypatch.setattr(accuracy, "machine_info", lambda root: {"git_commit": "abc123"})  # whatever the tree's state
    out = accuracy.main(
        [
            "--workloads",
            "digits:mlp",
            "--worlds",
            "2",
            "--scenarios",
            "random_k1",
            "--seeds",
            "0",
            "--policies",
            "wagma",
            "--out",
            str(tmp_path / "acc"),
            "--work",
            str(tmp_path / "work"),
        ]
    )
    by = {r["policy"]: r for r in out["records"]}
    assert by["allreduce"]["guard"] == {"ok": True, "warnings": []} and by["allreduce"]["loss_curve"] == curve
    assert by["wagma"]["guard"] == flagged and by["wagma"]["loss_curve"] == [[10, 2.0]]
    saved = results_io.load(tmp_path / "acc" / "accuracy.json.xz")  # and so does the grid's file
    assert {r["policy"]: r["guard"] for r in saved["records"]} == {
        "allreduce": {"ok": True, "warnings": []},
        "wagma": flagged,
    }


def test_calibrate_picks_the_target_from_the_curve_in_bits_per_byte(tmp_path, capsys):
    from benchmarks import calibrate

    evals = {250: 2.8, 500: 2.6, 750: 2.5}  # nats
    lines = [{"step": s, "elapsed_s": s / 10, "loss": 3.0} for s in range(1, 1001)]
    for rec in lines:
        if rec["step"] in evals:
            rec |= {"test_loss": evals[rec["step"]], "test_accuracy": 0.3}
    (tmp_path / "metrics_rank0.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    summary = {"steps": 1000, "test_loss": 2.4, "test_accuracy": 0.4, "test_bits_per_byte": 2.4 / math.log(2)}
    (tmp_path / "summary.json").write_text(json.dumps(summary | {"policy": "allreduce", "train_s": 99.0}))
    out = calibrate.main([str(tmp_path), "--at", "500", "--slack", "0.05", "--out", str(tmp_path / "c.json")])
    assert [p["step"] for p in out["curve"]] == [250, 500, 750, 1000] and out["curve"][-1]["elapsed_s"] == 100.0
    target = out["target"]
    assert target["loss_at_step"] == pytest.approx(2.6 / math.log(2)) and out["unit"] == "bits/byte"
    assert target["target_loss"] == pytest.approx(2.6 / math.log(2) + 0.05) and target["still_improving"]
    assert json.loads((tmp_path / "c.json").read_text())["target"] == target
    assert "still improving past step 500" in capsys.readouterr().out
    assert not calibrate.target(out["curve"][:2], 500, 0.0)["still_improving"]  # nothing after the target's step
    with pytest.raises(SystemExit):
        calibrate.main([str(tmp_path), "--at", "600"])
    assert "no evaluation at step 600; evaluated at [250, 500, 750, 1000]" in capsys.readouterr().err
