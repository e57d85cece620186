#!/usr/bin/env bash
# Everything a GPU lease measures, in one command (about 6 minutes on an H200):
#   1. the engine check with the code's defaults (targets, profile, hand-off, gpu-marked tests);
#   2. the attention kernels' settings sweep;
#   3. the engine check again with the sweep's best settings (into tuned/), so the defaults can
#      be set to what was measured through the whole engine without another lease.
# Each step has its own time limit and log: one that fails or hangs leaves the others' results.
# Run from the repository root: bash benchmarks/gpu_lease.sh   (results in $OUT, else ./gpu-out)
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-gpu-out}
mkdir -p "$out/tuned"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
timeout 330 python3 -m benchmarks.gpu_engine_check --out "$out" > "$out/engine_log.txt" 2>&1
echo "gpu_engine_check exit $?"
timeout 300 python3 -m benchmarks.attention_kernels --out "$out" > "$out/sweep_log.txt" 2>&1
echo "attention_kernels exit $?"
if [ -s "$out/attention_kernels.json" ]; then
    echo "== tuned" >> "$out/engine_log.txt"
    timeout 200 python3 -m benchmarks.gpu_engine_check --skip-tests --skip-handoff \
        --tuning-from "$out/attention_kernels.json" --out "$out/tuned" >> "$out/engine_log.txt" 2>&1
    echo "gpu_engine_check (tuned) exit $?"
fi
grep -E "^(ceilings|decode|prefill|hand-off|== tuned)" "$out/engine_log.txt"
tail -n 2 "$out/engine_log.txt" | cut -c1-3000
tail -n 30 "$out/sweep_log.txt" | cut -c1-3000
