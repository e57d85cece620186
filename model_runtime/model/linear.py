"""Matrix multiplies with the weight kept in the fastest form for the device.

* ``onednn`` (CPU with oneDNN): the weight is reordered once into oneDNN's blocked layout and
  multiplied by oneDNN. On AVX-512 CPUs where the BLAS library falls back to a generic path
  (e.g. MKL on AMD), this runs matrix-vector products at memory bandwidth and large products
  2x faster than ``torch.matmul``.
* ``transposed`` (CPU without oneDNN): the weight is stored [in, out], so a token's product
  streams contiguous rows; about 1.5x faster than the [out, in] layout for decode.
* ``dense`` (CUDA and everything else): ``F.linear`` on the [out, in] checkpoint layout.

``PDSERVE_LINEAR`` forces a backend (for benchmarks and debugging).

oneDNN keeps state per distinct input shape: a primitive (JIT code, and for some sizes an
[rows, out] buffer: 0.6-5 MiB each) in its own cache and in ideep's, 1,024 entries each. A
prefill step's row count changes with almost every step, so a worker's memory grew by about
3.7 MiB per distinct step size (+1.9 GB over the 512 sizes of a CPU step budget); the caches'
capacity variables count entries, not bytes, and a small capacity re-creates a primitive
(≈ 2 ms) on every new size. So the ``onednn`` backend pads its input to a few row counts
(``padded_rows``): at most 1/8 more rows (≈ 4 % on random lengths), and the rows of the result
are bit-identical to the unpadded product's here. A lightly loaded prefill worker still meets
those row counts one by one over minutes, its memory rising by each; ``warm_up`` creates them
all when the model loads (once per weight shape: layers of one shape share them), so a worker's
memory is flat from its first request.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F

BACKENDS = ("onednn", "transposed", "dense")
# Batch size oneDNN tunes the blocked layout for; measured to serve 1..4096 rows well.
_ONEDNN_HINT = 32
# Row counts below this reach oneDNN as they are: decode batches, where padding is dear (8 rows
# take about twice as long as 4 here); above it, eight buckets per power of two.
_EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """The row count the ``onednn`` backend multiplies ``rows`` rows as: ``rows`` below 16, else
    ``rows`` rounded up to a multiple of 1/8 of the power of two below it (16, 18, …, 32, 36, …,
    64, 72, …): less than 1/8 of padding, and 16 + 8 per doubling distinct shapes in all."""
    if rows < _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every row count ``padded_rows`` gives for 1..``max_rows`` rows, ascending."""
    top = padded_rows(max_rows)
    out = list(range(1, min(top, _EXACT_ROWS - 1) + 1))
    rows = _EXACT_ROWS
    while rows <= top:
        out.append(rows)
        rows = padded_rows(rows + 1)
    return out


# (in, out, bias, dtype, rows) of every product ``warm_up`` ran in this process: oneDNN's caches
# are per process and keyed by shape, so a second model of the same shapes needs none again.
_warmed: set[tuple[int, int, bool, torch.dtype, int]] = set()


def warm_up(linears: Iterable[Linear], max_rows: int) -> int:
    """Run each ``onednn`` product once at every row count a step of up to ``max_rows`` rows
    can bring (``row_buckets``), once per distinct weight shape in the process, so that oneDNN
    creates now what it would otherwise create at each first sight. Other backends keep no
    per-shape state and are skipped. Returns the number of products run."""
    ran = 0
    with torch.inference_mode():
        for lin in linears:
            if lin.backend != "onednn":
                continue
            shape = (lin.in_features, lin.out_features, lin.bias is not None, lin.dtype)
            todo = [rows for rows in row_buckets(max_rows) if (*shape, rows) not in _warmed]
            if not todo:
                continue
            x = torch.zeros(todo[-1], lin.in_features, dtype=lin.dtype)
            for rows in todo:
                lin(x[:rows])
                _warmed.add((*shape, rows))
                ran += 1
    return ran


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
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
        self.dtype = weight.dtype
        self.bias = bias
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_HINT)
        elif backend == "transposed":
            self.weight = weight.t().contiguous()
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn":
            rows = x.shape[0]
            if rows == 0:  # (a step that samples nothing): no oneDNN state for an empty product
                return x.new_empty(0, self.out_features)
            padded = padded_rows(rows)
            if padded != rows:  # zero rows: no NaN or denormal garbage in the rows thrown away
                x = F.pad(x, (0, 0, 0, padded - rows))
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight, self.bias, "none", [], ""
            )
            return out if padded == rows else out[:rows]
        if self.backend == "transposed":
            return torch.addmm(self.bias, x, self.weight) if self.bias is not None else x @ self.weight
        return F.linear(x, self.weight, self.bias)
