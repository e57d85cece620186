#!/usr/bin/env bash
# Everything a GPU lease measures, in one command (about 5 minutes on an H200): the engine check
# (targets, profile, hand-off, gpu-marked tests), then the attention kernels' settings sweep.
# Each step has its own time limit and log, so one that fails or hangs leaves the others' results.
# Run from the repository root: bash benchmarks/gpu_lease.sh   (results in $OUT, else ./gpu-out)
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-gpu-out}
mkdir -p "$out"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
timeout 330 python3 -m benchmarks.gpu_engine_check --out "$out" > "$out/engine_log.txt" 2>&1
echo "gpu_engine_check exit $?"
timeout 300 python3 -m benchmarks.attention_kernels --out "$out" > "$out/sweep_log.txt" 2>&1
echo "attention_kernels exit $?"
tail -n 3 "$out/engine_log.txt" | cut -c1-3000
tail -n 30 "$out/sweep_log.txt" | cut -c1-3000
