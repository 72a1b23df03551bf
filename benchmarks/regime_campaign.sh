#!/usr/bin/env bash
# The full compute-bound regime campaign (issue 13, points 1, 5, 6). Run it on a QUIET machine (nothing
# else running: the ranks share the cores, and the numbers are wall-clock times), from the repository root:
#
#     bash benchmarks/regime_campaign.sh          # about 20-25 min on the 2-core CI machine
#
# It writes benchmarks/results/regime.json, regime.md, regime_*.png (the measurements), then
# simulation.json, simulation.md, simulation_*.png (the simulator validated against them, and the
# extrapolation to 64..1,024 ranks). Environment: PYTHON (default python), OUT (default
# benchmarks/results), STEPS (timed steps per run, default 22 = two WAGMA periods), REPS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results}
STEPS=${STEPS:-22}
REPS=${REPS:-3}
start=$(date +%s)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# 1. The grid: T = 100 ms of emulated compute, a 0.25 M-parameter MLP, P = 4, 8, 16, every scenario and
#    policy, REPS repetitions (medians). 72 worlds; about 16 s each.
"$PY" benchmarks/regime.py --compute-ms 100 --params 0.25e6 --worlds 4 8 16 \
    --steps "$STEPS" --warmup 3 --reps "$REPS" --out "$OUT" --no-report
echo "grid done after $(( $(date +%s) - start )) s"

# 2. Payloads: 2.5 M and 25 M parameters at P = 8 under random_k1 (about 3 min; 25 M needs ~6 GB of RAM).
"$PY" benchmarks/regime.py --compute-ms 100 --params 2.5e6 25e6 --worlds 8 --scenarios random_k1 \
    --policies allreduce wagma eager_solo --steps "$STEPS" --warmup 3 --reps "$REPS" --out "$OUT" --append
echo "payload sweep done after $(( $(date +%s) - start )) s"

# 3. The simulator against every run above, and the paper-setting extrapolation (about 2-3 min).
"$PY" benchmarks/scale.py --regime "$OUT/regime.json" --out "$OUT"
echo "campaign done in $(( $(date +%s) - start )) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
