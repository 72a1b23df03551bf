#!/usr/bin/env bash
# The GPU checklist (docs/gpu.md: the GPU tests, the kernel benchmark, telemetry, the regime on CUDA) in one command, for a lent GPU machine with a short budget: each item under its own
# deadline, every output kept, a failing item does not stop the next. Run from the repository root:
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checklist.sh
#
# Files written to $OUT (the device tool brings back at most 8): env.txt, pytest_gpu.txt, gpu.json, gpu_bench.txt,
# telemetry.txt (train.py on CUDA: its log, summary and metrics records with gpu_* fields), regime_cuda.json.xz and
# regime_cuda.txt (the compute-bound regime benchmark with the model on CUDA, 25 M parameters). Item 1 includes
# tests/gpu_worlds.py on CUDA, whose checks cover HSDP x WAGMA (FSDP2 on CUDA tensors over gloo, 4 ranks on one GPU).
#
# The machine has no package index: the project runs from the checkout (PYTHONPATH), and Python packages it lacks
# (Hydra, OmegaConf, antlr4, SimPy) travel as wheels in .whl/ (see /work/.library/device/README.md), installed to
# /tmp/site. torchft is not among them: it needs opentelemetry, which that machine lacks, and an installed
# package that fails to import stops pytest's collection (without it, its tests skip). Deadlines (seconds) can be
# changed with T_PYTEST, T_KERNELS, T_TRAIN, T_REGIME.
set -u
OUT=${OUT:-/tmp/gpu_checklist}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3

{
    date -u
    git rev-parse HEAD 2>/dev/null || true
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))'
    $PY -c 'import cupy; print("cupy", cupy.__version__)' 2>&1
    $PY -c 'import pynvml; print("nvidia-ml-py", getattr(pynvml, "__version__", "?"))' 2>&1
    $PY -c 'import wagma.kernels as K; print("wagma.kernels backend:", K.backend())' 2>&1
} >"$OUT/env.txt" 2>&1

echo "== 1. GPU-marked tests"
timeout "${T_PYTEST:-180}" $PY -m pytest -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"

echo "== 2. kernel bandwidth and the engine on CUDA tensors"
timeout "${T_KERNELS:-130}" $PY benchmarks/gpu.py --reps 20 --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.txt"

echo "== 3. train.py on CUDA with GPU telemetry"
RUN=/tmp/gpu_train
rm -rf "$RUN"
{
    timeout "${T_TRAIN:-70}" $PY train.py device=cuda nproc=1 steps=150 averaging=allreduce telemetry_interval_s=0.1 \
        log_every=10 eval_every=50 progress=false run_dir="$RUN"
    echo "== summary.json"
    cat "$RUN/summary.json"
    echo
    echo "== metrics_rank0.jsonl: records with gpu_* fields"
    grep -h '"gpu_' "$RUN"/metrics_rank0.jsonl | head -n 5
} >"$OUT/telemetry.txt" 2>&1
tail -n 12 "$OUT/telemetry.txt"

echo "== 4. compute-bound regime, model on CUDA (ranks share the GPU through gloo), 25 M parameters"
timeout "${T_REGIME:-110}" $PY benchmarks/regime.py --device cuda --params 25e6 --worlds 4 --scenarios random_k1 \
    --policies allreduce wagma eager_solo --compute-ms 100 --steps 5 --warmup 2 --reps 1 --no-report \
    --out /tmp/regime_cuda 2>&1 | tee "$OUT/regime_cuda.txt"
cp /tmp/regime_cuda/regime.json.xz "$OUT/regime_cuda.json.xz" 2>/dev/null || true

echo "== done"
