"""The chaos suite's shared work: greedy streams and their HF references, computed once for
every module that runs faults (the references take seconds to compute)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def work() -> Any:
    chaos = pytest.importorskip("benchmarks.chaos")
    pytest.importorskip("transformers")
    return chaos.make_work(seed=3, streams=8, after=4)
