"""One in-process deployment (1 prefill + 1 decode worker, no Ray) for the monitoring tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="package")
def service() -> Iterator[Any]:
    """The deployment's ``Endpoints``; the router is imported here, so the offline tests
    (rules, dashboard JSON) never need it."""
    from tests.service.helpers import start_service

    st, ep = start_service(use_ray=False)
    try:
        yield ep
    finally:
        st.stop()
