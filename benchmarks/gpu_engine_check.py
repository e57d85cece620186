"""Prepared GPU check for the model runtime (one command, a few minutes on one GPU).

1. the ``gpu``-marked engine tests (CUDA float32 token-exact with HF, bfloat16 serving, seeds);
2. ``engine_roofline.py --device cuda --skip-hf``: decode MBU and prefill MFU against the
   device's own bandwidth and bf16 matmul measured in the same run.

Run: ``python -m benchmarks.gpu_engine_check``. The last line is one JSON object.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/engine/test_gpu.py"], cwd=ROOT
    )
    bench = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_roofline", "--device", "cuda", "--skip-hf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(bench.stdout + bench.stderr[-4000:])
    lines = [ln for ln in bench.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    result.update(
        gpu=torch.cuda.get_device_name(0), gpu_tests_rc=tests.returncode, roofline_rc=bench.returncode
    )
    print(json.dumps(result, sort_keys=True))
    return tests.returncode or bench.returncode


if __name__ == "__main__":
    sys.exit(main())
