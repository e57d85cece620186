"""The router's process keeps what start-up allocated out of later garbage collections."""

from __future__ import annotations

import gc

from pdserve.router.server import settle_heap


def test_settle_heap_takes_what_lives_now_out_of_every_collection() -> None:
    started = [object() for _ in range(3)]  # a container from before serving starts
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is started for o in gc.get_objects())  # no collection walks it
        later = [object()]
        assert any(o is later for o in gc.get_objects())  # what serving allocates is collected
    finally:
        gc.unfreeze()
