"""``pdserve profile``'s link measurement runs real transfers between two transports."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.profile import measure_link


@pytest.mark.parametrize("link", ["shm", "tcp"])
def test_measure_link_moves_blocks_and_fits_a_bandwidth(link: str) -> None:
    args = argparse.Namespace(link=link, link_gbps=None, link_latency_us=0.0)
    latency, bandwidth, how = measure_link(args, (2, 256, 2, 4, 1, 8), torch.float32)
    assert latency >= 0.0
    assert 1e6 < bandwidth < float("inf")
    assert how.startswith(link)
