"""GPU data paths (skipped without CUDA; run by benchmarks/gpu_kvtransfer.py as well)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_kvtransfer

pytestmark = pytest.mark.gpu


def test_cuda_ipc_between_two_processes_on_one_gpu_is_byte_exact() -> None:
    result = gpu_kvtransfer.run("cuda_ipc", 0, 0)
    assert result["byte_exact"], result


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_nccl_between_two_gpus_is_byte_exact() -> None:
    result = gpu_kvtransfer.run("nccl", 1, 0)
    assert result["byte_exact"], result
