"""What a role engine needs from the process around it (pure): a step runner, a KV transport, a
runtime holding them with the block pool, and a clock.

The worker host plugs in the real ones (the model runner, ``KVTransport``, ``time.monotonic``);
the simulator plugs in a runner that only names the step's duration, a transport that takes
the profile's link time and a virtual clock, and runs the same ``PrefillEngine`` and
``DecodeEngine`` code.

Contracts are ``KVTransport``'s (``pdserve.kvtransfer.transport``): the transport never
allocates or frees blocks; after ``poll`` reports a transfer, its owner calls ``forget``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.kvtransfer.states import Completions
from pdserve.model_runtime.engine.runner import Runner, StepResult
from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.validation import RequestLimits
from pdserve.worker.grammar_gate import Compiles

Clock = Callable[[], float]  # seconds, monotonic

__all__ = ["Clock", "RoleRuntime", "Runner", "StepResult", "Transport"]


class Transport(Protocol):
    @property
    def address(self) -> str: ...

    @property
    def offers(self) -> list[str]: ...

    @property
    def rank_addresses(self) -> tuple[str, ...]:
        """Every rank's address, rank 0's first, for a worker of several KV ranks; else empty."""
        ...

    def expect(
        self, transfer_id: str, dst_blocks: Sequence[int], source_ranks: int = 1, lease_s: float | None = None
    ) -> None:
        """Accept one transfer from a worker with ``source_ranks`` KV ranks."""
        ...

    def send(
        self,
        transfer_id: str,
        peer: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        layerwise: bool = False,
        timeout_s: float | None = None,
        peer_offers: Sequence[str] | None = None,
        peer_ranks: Sequence[str] = (),
    ) -> None:
        """``peer_ranks``: the receiving worker's ranks (``KVTarget.ranks``)."""
        ...

    def layer_ready(self, transfer_id: str, layer: int) -> None: ...

    def cancel(self, transfer_id: str) -> None: ...

    def poll(self) -> Completions: ...

    def forget(self, transfer_id: str) -> None: ...

    def num_records(self) -> int: ...

    @property
    def settling(self) -> bool:
        """Transfers the engine forgot still have parts ending: keep polling (``poll``)."""
        ...


class RoleRuntime(Protocol):
    """The loaded model's side of a worker, as the role engines use it."""

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def runner(self) -> Runner: ...

    @property
    def block_size(self) -> int: ...

    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def grammars(self) -> Compiles | None: ...

    def limits(self, max_prompt_tokens: int = 0, max_tokens_cap: int = 0) -> RequestLimits: ...
