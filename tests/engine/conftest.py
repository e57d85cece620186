"""Every engine a test creates must end the test with a consistent pool and, when idle, no
blocks in use and no per-request state: leaks fail the test that caused them."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest

from pdserve.decode_worker.offline import OfflineDriver

_live: weakref.WeakSet[OfflineDriver] = weakref.WeakSet()
_orig_init = OfflineDriver.__init__


def _tracking_init(self: OfflineDriver, *args: object, **kwargs: object) -> None:
    _orig_init(self, *args, **kwargs)  # type: ignore[arg-type]
    _live.add(self)


OfflineDriver.__init__ = _tracking_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _engines_end_clean() -> Iterator[None]:
    yield
    for engine in list(_live):
        engine.check_integrity()
