"""Shared test set-up: presets are materialised into a per-session temporary cache."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

_CACHE = tempfile.mkdtemp(prefix="pdserve-test-cache-")
os.environ.setdefault("PDSERVE_CACHE", _CACHE)
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
