"""Matrix multiplies with the weight kept in the fastest form for the device.

* ``onednn`` (CPU with oneDNN): the weight is reordered once into oneDNN's blocked layout and
  multiplied by oneDNN. On AVX-512 CPUs where the BLAS library falls back to a generic path
  (e.g. MKL on AMD), this runs matrix-vector products at memory bandwidth and large products
  2x faster than ``torch.matmul``.
* ``transposed`` (CPU without oneDNN): the weight is stored [in, out], so a token's product
  streams contiguous rows; about 1.5x faster than the [out, in] layout for decode.
* ``dense`` (CUDA and everything else): ``F.linear`` on the [out, in] checkpoint layout.

``PDSERVE_LINEAR`` forces a backend (for benchmarks and debugging).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

BACKENDS = ("onednn", "transposed", "dense")
# Batch size oneDNN tunes the blocked layout for; measured to serve 1..4096 rows well.
_ONEDNN_HINT = 32


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        w = torch.randn(24, 40).to(dtype)
        x = torch.randn(3, 40).to(dtype)
        b = torch.randn(24).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _ONEDNN_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(x, w, b).float(), atol=5e-2, rtol=5e-2))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def choose_backend(device: torch.device, dtype: torch.dtype) -> str:
    forced = os.environ.get("PDSERVE_LINEAR")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"PDSERVE_LINEAR={forced!r}; choose one of {', '.join(BACKENDS)}")
        if forced == "onednn" and (device.type != "cpu" or not _onednn_works(dtype)):
            raise ValueError("PDSERVE_LINEAR=onednn needs a CPU device with working oneDNN")
        return forced
    if device.type != "cpu":
        return "dense"
    return "onednn" if _onednn_works(dtype) else "transposed"


class Linear:
    """``y = x @ weight.T + bias`` for a 2-D ``x``; ``weight`` arrives as [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> None:
        self.backend = backend
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_HINT)
        elif backend == "transposed":
            self.weight = weight.t().contiguous()
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn":
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight, self.bias, "none", [], ""
            )
            return out
        if self.backend == "transposed":
            return torch.addmm(self.bias, x, self.weight) if self.bias is not None else x @ self.weight
        return F.linear(x, self.weight, self.bias)
