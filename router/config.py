"""Router settings (frozen). Defaults are safe: loopback addresses, finite caps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.model_runtime.generation_config import GenerationDefaults
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.router.slo import SloClass
from pdserve.router.tls import TlsConfig
from pdserve.steptime.model import StepTimeModel


@dataclass(frozen=True)
class Caps:
    """Per-request limits enforced before any worker sees the request (0: context only)."""

    max_prompt_tokens: int = 0
    max_tokens: int = 4096
    max_n: int = 8
    max_logprobs: int = 20
    default_max_tokens: int = SamplingParams.max_tokens  # a request that names none

    def with_defaults(
        self, defaults: GenerationDefaults, fields: Mapping[str, Any], max_tokens: int | None
    ) -> dict[str, Any]:
        """A request's sampling ``fields`` with the unset (``None``) ones filled: the model's
        defaults first (``SamplingParams``' own after that), and ``max_tokens`` from the model's
        ``max_new_tokens`` held to the cap, else ``default_max_tokens``."""
        filled = defaults.fill({**fields, "max_tokens": max_tokens})
        if max_tokens is None:
            filled["max_tokens"] = min(filled.get("max_tokens", self.default_max_tokens), self.max_tokens)
        return filled

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_n", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prompt_tokens < 0 or self.max_logprobs < 0:
            raise ValueError("max_prompt_tokens and max_logprobs must be >= 0")


# The shortest liveness timeout: twice the heartbeat of an idle worker
# (``pdserve.worker.push.HEARTBEAT_S``), so that a live worker is never taken for a lost one.
MIN_LIVENESS_S = 1.0
MAX_ROUTERS = 64  # router replicas: every worker keeps a connection to each


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    tls: TlsConfig | None = None  # TLS (and mutual TLS) on both front ends; None: plaintext
    caps: Caps = Caps()
    policy: str = "goodput"  # goodput | least_loaded | round_robin
    latency_profile: StepTimeModel | None = None  # goodput prior (None: h100-llama3-8b); corrected online
    # The prefill pool's, where its degree differs (None: ``latency_profile``): prompts are
    # priced on the GPUs that compute them.
    prefill_latency_profile: StepTimeModel | None = None
    local_prefill: bool = True  # goodput: decode workers may prefill (conditional disaggregation)
    slo_classes: tuple[SloClass, ...] = ()  # none: one class "default" without targets
    default_slo_class: str = ""  # "": the first class
    model_name: str = ""  # the id /v1/models lists; "" uses the model directory's name
    reserve_timeout_s: float = 30.0  # waiting for decode KV room before RESOURCE_EXHAUSTED
    call_timeout_s: float = 30.0  # any single router -> worker call
    max_inflight: int = 4096  # requests in flight before RESOURCE_EXHAUSTED
    grpc_max_message_bytes: int = 16 << 20
    drain_timeout_s: float = 30.0
    # A stream whose decode worker is lost continues on another one (prompt + the tokens already
    # sent, recomputed there) at most this many times; 0: it fails UNAVAILABLE, with the reason.
    migration_limit: int = 3
    # Prompts that have not started move when the prefill pool gains a worker or starts to lose
    # one (``pdserve.router.rebalance``); False: a prompt stays where it was sent.
    rebalance_prefill: bool = True
    liveness_timeout_s: float = 4.0  # a worker silent this long (no heartbeat) is lost
    worker_channel_host: str = "127.0.0.1"  # where workers push outputs (a node IP for multi-node)
    # Router replicas over the one pool (``pdserve serve --routers N``); above 1, the serve
    # process owns the pool and N replica processes serve the front ends (``deploy/replicas.py``).
    routers: int = 1
    # A replica's name, sent with every response (HTTP header ``x-pdserve-router``, gRPC
    # metadata ``pdserve-router``) so a client or a test knows which replica served it; "": none.
    router_id: str = ""

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be 0-65535 (0: a free port), got {port}")
        for name in ("reserve_timeout_s", "call_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not (self.drain_timeout_s >= 0 and math.isfinite(self.drain_timeout_s)):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s}")
        # NaN or 0 here had every worker declared lost at its first silence, and replaced, in a loop
        if not (self.liveness_timeout_s >= MIN_LIVENESS_S and math.isfinite(self.liveness_timeout_s)):
            raise ValueError(
                f"liveness_timeout_s must be a finite number >= {MIN_LIVENESS_S:g} (twice the workers' "
                f"heartbeat), got {self.liveness_timeout_s}"
            )
        if not 1 <= self.routers <= MAX_ROUTERS:
            raise ValueError(f"routers must be 1-{MAX_ROUTERS}, got {self.routers}")
        if self.routers > 1 and self.tls is not None and self.tls.mutual:
            raise ValueError("router replicas (routers > 1) do not serve mutual TLS yet: use one router")
        if len(self.router_id) > 64 or not self.router_id.isprintable():
            raise ValueError("router_id must be printable and at most 64 characters")
        if self.max_inflight < 1 or self.grpc_max_message_bytes < 1 or self.migration_limit < 0:
            raise ValueError("max_inflight and grpc_max_message_bytes must be >= 1, migration_limit >= 0")
