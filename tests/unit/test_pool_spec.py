"""``PoolSpec``: what a private Ray instance is sized for, and the internal TLS material every
worker spec must carry when the deployment asks for it."""

from __future__ import annotations

import pytest

from pdserve.deploy.pools import PoolSpec
from pdserve.kvtransfer.tls import InternalTls
from pdserve.worker.messages import WorkerRole


def test_capacity_is_the_larger_of_the_first_layout_and_the_maximum() -> None:
    assert PoolSpec(prefill=2, decode=1).capacity == 3
    assert PoolSpec(prefill=1, decode=1, max_workers=7).capacity == 7
    assert PoolSpec(prefill=4, decode=4, max_workers=2).capacity == 8
    with pytest.raises(ValueError, match="max_workers"):
        PoolSpec(max_workers=-1)


def test_internal_tls_reaches_every_worker_spec_or_none() -> None:
    secret = b"s" * 32
    plain = PoolSpec().worker_specs(secret)
    assert all(ws.internal_tls is None for ws in plain)
    specs = PoolSpec(internal_tls=True).worker_specs(secret)
    assert len({id(ws.internal_tls) for ws in specs}) == 1 and specs[0].internal_tls is not None
    tls = InternalTls.generate()
    assert (
        PoolSpec(internal_tls=True).worker_spec(WorkerRole.DECODE, "decode-9", secret, tls=tls).internal_tls
        is tls
    )
    with pytest.raises(ValueError, match="internal_tls"):
        PoolSpec(internal_tls=True).worker_spec(WorkerRole.DECODE, "decode-9", secret)
    assert PoolSpec().worker_spec(WorkerRole.DECODE, "decode-9", secret, tls=tls).internal_tls is None
