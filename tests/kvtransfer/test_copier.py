"""BlockCopier: every byte lands, whatever the thread count and piece sizes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.kvtransfer.copier import BlockCopier


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_scattered_and_run_copies_are_exact(threads: int) -> None:
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 255, size=(6, 64, 40_000), dtype=np.uint8)  # [layers, blocks, bytes]
    dst = np.zeros_like(src)
    copier = BlockCopier(threads)
    try:
        order = random.Random(threads).sample(range(64), 64)
        blocks = list(zip(order[:40], range(40), strict=True))  # 40 scattered blocks, ~9.6 MB
        copier.copy([(dst[:, d], src[:, s]) for s, d in blocks])
        for s, d in blocks:
            assert np.array_equal(dst[:, d], src[:, s])
        assert not dst[:, 40:].any()  # nothing beyond the destinations
        copier.copy([(dst[:, 40:64], src[:, 0:24])])  # one run: cut into pieces
        assert np.array_equal(dst[:, 40:64], src[:, 0:24])
        copier.copy([(dst[2:3, 5:6], src[4:5, 7:8])])  # small: the calling thread alone
        assert np.array_equal(dst[2, 5], src[4, 7])
    finally:
        copier.close()


def test_a_failed_piece_raises_after_every_thread_stopped() -> None:
    src = np.ones((4, 64, 40_000), dtype=np.uint8)
    dst = np.zeros_like(src)
    bad = (np.zeros(3, dtype=np.uint8), np.ones(5, dtype=np.uint8))  # shapes do not broadcast
    copier = BlockCopier(2)
    try:
        pairs = [(dst[:, b], src[:, b]) for b in range(64)]
        with pytest.raises(ValueError):
            copier.copy([*pairs[:32], bad, *pairs[32:]])
        # Every other piece was still copied (threads drain the shared work), none half-way.
        assert int(dst.sum()) == dst.size
        copier.copy(pairs)  # and the copier still works
    finally:
        copier.close()
