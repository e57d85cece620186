"""``RouterConfig`` refuses settings that would misbehave later rather than fail now."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.router.config import MIN_LIVENESS_S, RouterConfig
from pdserve.worker.push import HEARTBEAT_S


def test_the_defaults_are_valid_and_the_liveness_floor_outlasts_two_heartbeats() -> None:
    RouterConfig()
    assert MIN_LIVENESS_S >= 2 * HEARTBEAT_S


@pytest.mark.parametrize(
    "field,value",
    [
        ("http_port", 65536),
        ("grpc_port", -1),
        ("reserve_timeout_s", 0.0),
        ("call_timeout_s", math.inf),
        ("call_timeout_s", math.nan),
        ("drain_timeout_s", -1.0),
        ("drain_timeout_s", math.nan),
        ("liveness_timeout_s", math.nan),
        ("liveness_timeout_s", 0.0),
        ("liveness_timeout_s", 1e-40),
        ("liveness_timeout_s", math.inf),
        ("max_inflight", 0),
        ("grpc_max_message_bytes", 0),
        ("migration_limit", -1),
        ("routers", 0),
        ("routers", 65),
        ("router_id", "x" * 65),
        ("router_id", "a\nb"),
    ],
)
def test_absurd_values_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_liveness_timeout_is_taken_exactly_when_finite_and_past_the_floor(value: float) -> None:
    ok = math.isfinite(value) and value >= MIN_LIVENESS_S
    try:
        RouterConfig(liveness_timeout_s=value)
    except ValueError:
        assert not ok
    else:
        assert ok


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_ports_are_taken_exactly_in_range(port: int) -> None:
    try:
        RouterConfig(http_port=port)
    except ValueError:
        assert not 0 <= port <= 65535
    else:
        assert 0 <= port <= 65535


def test_router_replicas_refuse_mutual_tls_for_now() -> None:
    from pdserve.router.tls import TlsConfig

    tls = TlsConfig(cert_file="c.pem", key_file="k.pem", client_ca_file="ca.pem")
    with pytest.raises(ValueError, match="mutual TLS"):
        RouterConfig(routers=2, tls=tls)
    assert RouterConfig(routers=1, tls=tls).routers == 1
