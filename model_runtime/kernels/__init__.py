"""GPU kernels for the engine's ``paged`` backend (Triton), their torch references, and the
``pdserve::`` custom ops that put one or the other behind a single dispatcher call.

* ``launch``: one kernel source, compiled for CUDA or run by Triton's interpreter on CPU tensors;
* ``paged_attention``: split-K decode and varlen prefill attention over the block-major cache;
* ``fused``: RMSNorm (with the residual add), RoPE + KV write, SiLU·mul;
* ``reference``: the same contracts in plain torch (the CPU implementation and the tests' oracle);
* ``ops``: the custom ops, with shape-only implementations for the ``meta`` device and tracing.
"""

import os as _os

import torch as _torch

# Triton decides at import whether its own library functions are interpreted; in a process
# without CUDA interpreting is the only way to run a kernel, so choose it before anything here
# imports Triton (``launch`` explains).
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")
