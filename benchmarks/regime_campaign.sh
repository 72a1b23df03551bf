#!/usr/bin/env bash
# The full compute-bound regime campaign (issue 13, points 1, 5, 6). Run it on a QUIET machine (nothing
# else running: the ranks share the cores, and the numbers are wall-clock times), from the repository root:
#
#     bash benchmarks/regime_campaign.sh          # 39 min on the 2-core CI machine (measured on ccd9d76, quiet)
#                                                 (before the four gossip baselines joined the default policies of
#                                                 its grid; they add their own runs to it)
#
# It writes benchmarks/results/regime/: regime.json.xz, regime.md, regime_*.png (the measurements), then
# benchmarks/results/simulation/: simulation.json, simulation.md, simulation_*.png (the simulator validated against
# them, and the extrapolation to 64..1,024 ranks). Environment: PYTHON (default python), OUT (default
# benchmarks/results/regime), SIM_OUT (default benchmarks/results/simulation), STEPS (timed steps per run,
# default 22 = two WAGMA periods), REPS (default 3),
# SWEEP_STEPS (timed steps of the 2.5 M / 25 M payload runs, default 11 = one WAGMA period), SWEEP=0 skips them,
# TARGETS=0 skips the 1 M-parameter target point; HORIZON=1 adds the 200-step runs (about 45 min more), LONG=1
# the 600-step runs (about 43 min more), QUOTA=1 the target point with per-rank CPU quotas (about 8 min);
# for a dry run of the script itself: WORLDS, SCENARIOS, COMPUTE_MS, SCALE_ARGS (extra scale.py options).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/regime}
SIM_OUT=${SIM_OUT:-benchmarks/results/simulation}
STEPS=${STEPS:-22}
REPS=${REPS:-3}
SWEEP=${SWEEP:-1}
SWEEP_STEPS=${SWEEP_STEPS:-11}
WORLDS=${WORLDS:-4 8 16}
SCENARIOS=${SCENARIOS:-random_k1 random_k2 persistent heavy_tail}
COMPUTE_MS=${COMPUTE_MS:-100}
SCALE_ARGS=${SCALE_ARGS:-}
start=$(date +%s)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# 1. The grid: T = 100 ms of emulated compute, a 0.25 M-parameter MLP, P = 4, 8, 16, every scenario and
#    policy, REPS repetitions (medians). 72 worlds; about 16-26 s each (P = 4 ... 16), ~19-23 min.
# shellcheck disable=SC2086  # WORLDS and SCENARIOS are lists
"$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 0.25e6 --worlds $WORLDS --scenarios $SCENARIOS \
    --steps "$STEPS" --warmup 3 --reps "$REPS" --out "$OUT" --no-report
echo "grid done after $(( $(date +%s) - start )) s"

# 2. Payloads: 2.5 M and 25 M parameters at P = 8 under random_k1 (25 M needs ~6 GB of RAM, and its real
#    forward/backward/step on 2 cores is no longer small next to T: about 3-5 min in all, unmeasured quiet).
if [ "$SWEEP" != 0 ]; then
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 2.5e6 25e6 --worlds 8 --scenarios random_k1 \
        --policies allreduce wagma eager_solo --steps "$SWEEP_STEPS" --warmup 3 --reps "$REPS" --out "$OUT" --append
    echo "payload sweep done after $(( $(date +%s) - start )) s"
else
    "$PY" benchmarks/regime.py --out "$OUT" --report-only
fi

# 3. The target point of issue 13 (point 3): 1 M parameters, P = 8 and 16, random_k1 and no imbalance (the
#    overhead against DDP), the reference policies beside their overlap and relaxed presets. 28 worlds, about 12 min.
if [ "${TARGETS:-1}" != 0 ]; then
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 1e6 --worlds 8 16 --scenarios random_k1 none \
        --policies allreduce wagma wagma_overlap wagma_relaxed wagma_relaxed_overlap eager_solo eager_solo_overlap \
        --steps "$STEPS" --warmup 3 \
        --reps "$REPS" --out "$OUT" --append
    echo "target point done after $(( $(date +%s) - start )) s"
fi

# 4. (HORIZON=1) The same protocols over 200 timed steps, into $OUT/variants/horizon: over 22 steps the slowest rank's share
#    of the random delays keeps even ranks that never wait at 0.93-0.95 of the ideal on this trace (`no_wait_ms`;
#    0.90-0.92 on a typical draw), over 200 at about 0.96. 0.25 M parameters (random_k1; 15 min), then 1 M (random_k1, P = 8 and 16; 22 min) and the
#    overhead without imbalance (1 M, P = 8; 8 min).
if [ "${HORIZON:-0}" != 0 ]; then
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 0.25e6 --worlds 8 16 --scenarios random_k1 \
        --policies allreduce wagma wagma_relaxed wagma_relaxed_overlap --steps 200 --warmup 3 --reps "$REPS" \
        --out "$OUT/variants/horizon"
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 1e6 --worlds 8 16 --scenarios random_k1 \
        --policies allreduce wagma wagma_relaxed_overlap eager_solo eager_solo_overlap --steps 200 --warmup 3 \
        --reps "$REPS" --out "$OUT/variants/horizon" --append
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 1e6 --worlds 8 --scenarios none \
        --policies allreduce wagma eager_solo --steps 200 --warmup 3 --reps "$REPS" --out "$OUT/variants/horizon" --append
    echo "horizon runs done after $(( $(date +%s) - start )) s"
fi

# 5. (LONG=1) Over 600 timed steps, into $OUT/variants/horizon600: the cap rises to about 0.98. The relaxed presets at
#    0.25 M parameters, P = 8 (14 min) and 16 (17 min), then the reference wagma at 1 M parameters, P = 8 (12 min).
if [ "${LONG:-0}" != 0 ]; then
    for world in 8 16; do
        "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 0.25e6 --worlds "$world" --scenarios random_k1 \
            --policies allreduce wagma_relaxed wagma_relaxed_overlap --steps 600 --warmup 3 --reps "$REPS" \
            --out "$OUT/variants/horizon600" --append
    done
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 1e6 --worlds 8 --scenarios random_k1 \
        --policies allreduce wagma --steps 600 --warmup 3 --reps "$REPS" --out "$OUT/variants/horizon600" --append
    echo "600-step runs done after $(( $(date +%s) - start )) s"
fi

# 6. (QUOTA=1) Issue 30's re-measurement of the target point with ranks that behave like devices: every rank in its
#    own CPU cgroup capped at cores / P (0.25 at P = 8, 0.125 at P = 16 on 2 cores), into $OUT/variants/quota.
#    1 M parameters, random_k1; the reference wagma and the relaxed presets beside DDP (about 8 min).
if [ "${QUOTA:-0}" != 0 ]; then
    cores=$(nproc)
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 1e6 --worlds 8 --scenarios random_k1 \
        --policies allreduce wagma wagma_relaxed wagma_relaxed_overlap --steps "$STEPS" --warmup 3 --reps "$REPS" \
        --rank-cpus "$(python3 -c "print($cores / 8)")" --out "$OUT/variants/quota" --no-report
    "$PY" benchmarks/regime.py --compute-ms "$COMPUTE_MS" --params 1e6 --worlds 16 --scenarios random_k1 \
        --policies allreduce wagma_relaxed wagma_relaxed_overlap --steps "$STEPS" --warmup 3 --reps "$REPS" \
        --rank-cpus "$(python3 -c "print($cores / 16)")" --out "$OUT/variants/quota" --append
    echo "quota runs done after $(( $(date +%s) - start )) s"
fi

# 7. The simulator against every run above (seconds); the paper-setting extrapolation already committed in
#    $SIM_OUT/simulation.json is kept (without one it is computed: about 2-3 min).
# shellcheck disable=SC2086
"$PY" benchmarks/scale.py --regime "$OUT/regime.json.xz" --out "$SIM_OUT" --validate-only $SCALE_ARGS
echo "campaign done in $(( $(date +%s) - start )) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
