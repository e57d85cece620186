"""Paged attention in Triton, reading the block-major KV cache through its strides.

The cache of one layer is ``kv_layer[block, 0|1, offset, kv_head, dim]``; a sequence's keys are
found through its row of a block table (``int32 [rows, max_blocks]``): token ``t`` lives in block
``table[t // block_size]`` at offset ``t % block_size``. Nothing is gathered or padded: each
program loads a tile of token positions, maps them to cache addresses, and runs an online
softmax (FlashAttention's running max and sum) over them.

* **Decode** (one query token per sequence) is split-K ("flash-decoding"): program
  ``(row, kv_head, split)`` covers one share of the positions the row attends to and all the query
  heads that share that KV head (grouped-query attention: K and V are read once per group, and the
  group is the ``M`` of the ``tl.dot``), writing a partial output and its log-sum-exp; a second
  kernel merges the splits. The grid has a fixed number of splits (``attention_tuning``)
  and each row divides its own span among them — ``num_splits`` shares rounded up to the tile,
  at least ``min_split_tokens`` — so a row's arithmetic depends on its own length only, not on
  the batch it runs in (seeded sampling stays batch-independent), a captured CUDA graph keeps its
  grid, and neither the grid nor the partials grow with the longest context the block table can
  hold. Splits a short row leaves empty, and rows with ``seq_len == 0`` (a graph bucket's
  padding), store only a log-sum-exp of ``-inf``, which the merge skips without reading their
  partials.
* **Prefill** is varlen: program ``(sequence, query_head, query_tile)`` reads its sequence's keys
  from the cache (the step's own keys are written there first), so a chunk continuing a cached
  prefix and a fresh prompt are the same case; the causal mask is by absolute position.

Masked scores use a large finite negative rather than ``-inf`` so a tile whose every entry is
masked for some row cannot produce ``inf - inf``; the first real score rescales that row's
accumulators to zero (``exp(-1e30 - m) == 0``).

Sliding window (Mistral): a query at position ``p`` sees keys ``p - window < k <= p``;
``window == 0`` means none (the kernels get a window longer than any sequence instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.model_runtime.attention_tuning import DecodeLaunch, PrefillLaunch, current
from pdserve.model_runtime.kernels.launch import Kernel, next_power_of_2

# A global a Triton kernel reads must be a constexpr (the compiler refuses plain Python globals;
# the interpreter does not check).
_MASKED = tl.constexpr(-1.0e30)


def _load_kv_fn(
    KV, TABLE, pos, n_mask, kvh, offs_d, d_mask,
    stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Keys and values [positions, dim] of ``pos`` (masked by ``n_mask``) through a row of the
    block table at ``TABLE``."""
    blk = tl.load(TABLE + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    base = blk * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_tok + kvh * stride_kv_head
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(KV + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(KV + stride_kv_kv + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


def _softmax_step_fn(
    q, k, v, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr, MASK: tl.constexpr = True
):  # fmt: skip
    """One tile of the online softmax: scores of ``q`` against ``k`` where ``allowed`` (every
    score without ``MASK``), the running max ``m_i`` and sum ``l_i`` rescaled, ``acc`` +=
    weights @ ``v``."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if MASK:
        s = tl.where(allowed, s, _MASKED)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# Device functions the kernels call: decorated now (kernels are decorated on first launch),
# because a kernel resolves what it calls when it is compiled or interpreted.
_load_kv = triton.jit(_load_kv_fn)
_softmax_step = triton.jit(_softmax_step_fn)


def _decode_split_kernel(
    Q,
    KV,
    BT,
    LENS,
    O_PART,
    LSE_PART,
    stride_qb,
    stride_qh,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    scale,
    window,
    num_splits,
    min_split_tokens,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(LENS + row)
    first = tl.maximum(seq_len - window, 0)
    share = (seq_len - first + num_splits - 1) // num_splits
    per_split = tl.maximum((share + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_split_tokens)
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    work_mask = offs_g < tl.where(lo < hi, GROUP, 0)  # an empty split reads and writes no partial
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=work_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], _MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        k, v = _load_kv(
            KV, BT + row * stride_bt, pos, n_mask, kvh, offs_d, d_mask,
            stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head, BLOCK_SIZE,
        )  # fmt: skip
        m_i, l_i, acc = _softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc, scale, PRECISION)
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    tl.store(
        O_PART + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        out,
        mask=work_mask[:, None] & d_mask[None, :],
    )
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(LSE_PART + row * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


def _decode_merge_kernel(
    O_PART,
    LSE_PART,
    OUT,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(LSE_PART + row * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    parts = tl.load(  # an empty split's partial was never written: not read either
        O_PART + row * stride_ob + head * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=(s_mask & (lse > float("-inf")))[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + row * stride_outb + head * stride_outh + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)


def _prefill_kernel(
    Q,
    KV,
    O,
    BT,
    CU_Q,
    START,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt,
    scale,
    window,
    GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)  # the longest tiles first: a shorter tail
    q0 = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q0
    if tile * BLOCK_M < q_len:
        start_pos = tl.load(START + seq)
        kvh = head // GROUP
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        q_pos = start_pos + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            Q + (q0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        hi = start_pos + tl.minimum((tile + 1) * BLOCK_M, q_len)
        lo = tl.maximum(start_pos + tile * BLOCK_M - window + 1, 0)
        m_i = tl.full([BLOCK_M], _MASKED, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        # Whole tiles of keys at or before the tile's first query are seen by every row: no
        # mask. With a window, rows lose keys at the low end too, so every tile is masked.
        unmasked_end = lo
        if not HAS_WINDOW:
            unmasked_end = lo + (start_pos + tile * BLOCK_M + 1 - lo) // BLOCK_N * BLOCK_N
        every = offs_n < BLOCK_N
        for start in range(lo, unmasked_end, BLOCK_N):
            k, v = _load_kv(
                KV, BT + seq * stride_bt, start + offs_n, every, kvh, offs_d, d_mask,
                stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head, BLOCK_SIZE,
            )  # fmt: skip
            m_i, l_i, acc = _softmax_step(q, k, v, every[None, :], m_i, l_i, acc, scale, PRECISION, False)
        for start in range(unmasked_end, hi, BLOCK_N):
            k_pos = start + offs_n
            n_mask = k_pos < hi
            k, v = _load_kv(
                KV, BT + seq * stride_bt, k_pos, n_mask, kvh, offs_d, d_mask,
                stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head, BLOCK_SIZE,
            )  # fmt: skip
            allowed = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _softmax_step(q, k, v, allowed, m_i, l_i, acc, scale, PRECISION)
        out = acc / l_i[:, None]
        tl.store(
            O + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


DECODE_SPLIT = Kernel(_decode_split_kernel)
DECODE_MERGE = Kernel(_decode_merge_kernel)
PREFILL = Kernel(_prefill_kernel)


def _precision(dtype: torch.dtype) -> str:
    # float32 engines are the token-exact ones: no TF32 rounding inside the dot products.
    return "ieee" if dtype == torch.float32 else "tf32"


_NO_WINDOW = 1 << 30


def _window(window: int) -> int:
    return window if window > 0 else _NO_WINDOW


def _tile(n: int) -> int:
    return max(16, next_power_of_2(n))


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    num_splits: int,
    min_split_tokens: int,
    launch: DecodeLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, D] (one token per row) over each row's cached keys; [B, Hq, D]
    (into ``out`` when given). Each row's span is shared among ``num_splits`` programs per KV
    head, each taking at least ``min_split_tokens`` positions; ``launch``: the process's
    (``attention_tuning.current``) unless given."""
    launch = launch or current().decode
    rows, n_q, dim = q.shape
    _, _, block_size, n_kv, _ = kv_layer.shape
    group = n_q // n_kv
    if num_splits <= 0 or min_split_tokens <= 0:
        raise ValueError(
            f"num_splits and min_split_tokens must be positive, got {num_splits} and {min_split_tokens}"
        )
    o_part = torch.empty(rows, n_q, num_splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, n_q, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    s = kv_layer.stride()
    DECODE_SPLIT.on(q.device.type)[(rows, n_kv, num_splits)](
        q, kv_layer, block_tables, seq_lens, o_part, lse,
        q.stride(0), q.stride(1),
        s[0], s[1], s[2], s[3],
        block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        scale, _window(window), num_splits, min_split_tokens,
        GROUP=group, BLOCK_G=_tile(group), BLOCK_N=launch.block_n, BLOCK_SIZE=block_size,
        HEAD_DIM=dim, BLOCK_D=next_power_of_2(dim), PRECISION=_precision(q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    DECODE_MERGE.on(q.device.type)[(rows, n_q)](
        o_part, lse, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=dim, BLOCK_D=next_power_of_2(dim), BLOCK_S=next_power_of_2(num_splits),
    )  # fmt: skip
    return out


def paged_prefill(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    start_pos: torch.Tensor,
    max_q_len: int,
    scale: float,
    window: int,
    launch: PrefillLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunks ``q`` [T, Hq, D]: sequence ``i`` owns rows
    ``cu_q[i]:cu_q[i+1]`` at absolute positions from ``start_pos[i]``, and its keys (cached and
    new) are in the cache through ``block_tables[i]``; [T, Hq, D]. ``launch``: the process's
    (``attention_tuning.current``) unless given."""
    launch = launch or current().prefill
    n_seqs = start_pos.shape[0]
    _, n_q, dim = q.shape
    _, _, block_size, n_kv, _ = kv_layer.shape
    out = torch.empty_like(q) if out is None else out
    s = kv_layer.stride()
    PREFILL.on(q.device.type)[(n_seqs, n_q, -(-max_q_len // launch.block_m))](
        q, kv_layer, out, block_tables, cu_q, start_pos,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        s[0], s[1], s[2], s[3],
        block_tables.stride(0),
        scale, _window(window),
        GROUP=n_q // n_kv, HAS_WINDOW=window > 0, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=dim, BLOCK_D=next_power_of_2(dim), PRECISION=_precision(q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return out
