"""Which engine backend runs on which device, and the sizes it works with (pure: no torch).

Two backends share the model's weights, its scheduler and its KV cache layout:

* ``TORCH`` — the CPU path: oneDNN linears, attention by gathering each sequence's blocks and
  one ``scaled_dot_product_attention`` call, elementwise work in eager torch. Fast on a CPU,
  where a gather is a memcpy and there is no launch cost.
* ``PAGED`` — the GPU path: ``pdserve::`` fused ops (Triton kernels), attention reading the
  block-major cache through block tables with no gather, every per-step index in one packed
  int32 buffer (one host→device copy a step), and pure-decode steps replayed from CUDA graphs
  captured per batch bucket.

``choose_backend`` is the one place the choice is made.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class Backend(enum.Enum):
    TORCH = "torch"
    PAGED = "paged"


def choose_backend(device_type: str, triton_available: bool, requested: str | None = None) -> Backend:
    """``requested`` (``EngineConfig.backend``; ``None`` or ``"auto"``: by device) wins where it
    can run: ``paged`` on CPU runs the ops' torch references (used to test the GPU path's
    plumbing); ``paged`` on CUDA needs Triton."""
    if requested not in (None, "auto"):
        try:
            backend = Backend(requested)
        except ValueError:
            names = ", ".join(b.value for b in Backend)
            raise ValueError(f"unknown engine backend {requested!r}; expected auto, {names}") from None
        if backend is Backend.PAGED and device_type == "cuda" and not triton_available:
            raise ValueError("the paged backend on CUDA needs Triton, which is not installed")
        return backend
    if device_type == "cuda" and triton_available:
        return Backend.PAGED
    return Backend.TORCH


OVERLAP_SETTINGS = ("auto", "on", "off")


def check_overlap(requested: str) -> None:
    if requested not in OVERLAP_SETTINGS:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP_SETTINGS)}, got {requested!r}")


def use_overlap(requested: str, device_type: str) -> bool:
    """Whether decode steps overlap (``EngineConfig.overlap``; ``auto``: on a GPU, whose steps run
    asynchronously to the host; a CPU computes a step while launching it, so there the overlap
    would only cost the extra row of each request that ends on a stop token)."""
    check_overlap(requested)
    return requested == "on" or (requested == "auto" and device_type == "cuda")


# Decode batch sizes a CUDA graph is captured for; a step pads up to the next one. Dense at the
# bottom (where single users live) and at most a third of padding above.
_BUCKETS = (1, 2, 4, *sorted(m << k for k in range(2, 15) for m in (2, 3)))  # 8, 12, 16, 24, …


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """The buckets up to ``max_rows`` (the engine's cap on sequences per step), ending with it."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    below = tuple(b for b in _BUCKETS if b < max_rows)
    return (*below, max_rows)


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``rows`` decode rows, or ``None`` (run eagerly)."""
    for b in buckets:
        if b >= rows:
            return b
    return None


# A step's token budget. On a CPU, 512 keeps a step's activations in cache and a decode batch
# waiting behind a prefill chunk short; on a GPU the budget is set by the matmul shape that
# reaches the tensor cores' rate: 8,192 tokens keeps prefill compute-bound.
CPU_STEP_TOKENS = 512
GPU_STEP_TOKENS = 8192


def default_step_tokens(on_gpu: bool) -> int:
    return GPU_STEP_TOKENS if on_gpu else CPU_STEP_TOKENS


# Requests a step holds at most. A GPU's decode batch is bandwidth-bound: it grows nearly free
# until the KV pool is full (an H100's holds some 300 conversation requests of an 8B model), so
# the cap is the common serving default rather than a cost; a CPU step's time grows with every
# row, and 64 keeps its decode steps short.
CPU_MAX_SEQS = 64
GPU_MAX_SEQS = 256


def default_max_seqs(on_gpu: bool) -> int:
    return GPU_MAX_SEQS if on_gpu else CPU_MAX_SEQS


def step_sizes(on_gpu: bool, step_tokens: int | None, max_seqs: int | None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): each the flag's when given, else the device's."""
    return step_tokens or default_step_tokens(on_gpu), max_seqs or default_max_seqs(on_gpu)


# What CUDA graphs of every bucket, the allocator's slack and the sampler's buffers take beyond a
# step's activations (a round figure: capture on an 8B model uses a few hundred MiB).
GRAPH_RESERVE_BYTES = 768 << 20


def step_reserve_bytes(
    step_tokens: int,
    max_seqs: int,
    hidden: int,
    intermediate: int,
    qkv_width: int,
    vocab: int,
    dtype_bytes: int,
    decode_scratch: int = 0,
) -> int:
    """Device memory the largest step needs besides weights and KV: the residual stream, the
    normed input, the qkv and gate/up outputs and the attention output of ``step_tokens`` tokens
    alive together; float32 logits of ``max_seqs`` rows several times over (sampling copies them);
    ``decode_scratch`` (``decode_scratch_bytes``: split attention's partials, held by the decode
    graphs' pool); ``GRAPH_RESERVE_BYTES``."""
    per_token = (3 * hidden + qkv_width + 3 * intermediate) * dtype_bytes
    return step_tokens * per_token + 4 * max_seqs * vocab * 4 + decode_scratch + GRAPH_RESERVE_BYTES


def decode_scratch_bytes(max_seqs: int, num_heads: int, head_dim: int, splits: int) -> int:
    """Split decode attention's float32 partial outputs and log-sum-exps for a full batch
    (``splits`` a row, whatever its length: ``attention_tuning``)."""
    return max_seqs * num_heads * splits * (head_dim + 1) * 4


def kv_blocks_for_free_memory(
    free_bytes: int, block_bytes: int, reserve_bytes: int, fraction: float = 0.9
) -> int:
    """Blocks that fit in ``fraction`` of the device memory still free after weights, less
    ``reserve_bytes`` (activations of the largest step, CUDA graphs)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    usable = int(free_bytes * fraction) - reserve_bytes
    return max(0, usable // block_bytes)
