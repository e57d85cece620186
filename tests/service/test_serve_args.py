"""``pdserve serve`` flags reach the engines they configure (no workers started)."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.deploy.pools import PoolSpec
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule
from pdserve.serve import build


def _spec(*flags: str) -> PoolSpec:
    return build(build_parser().parse_args(["serve", "--model", "tiny", "--device", "cpu", *flags]))[0]


def test_colocated_schedule_defaults_to_chunked_and_can_be_prefill_priority() -> None:
    assert _spec("--colocated", "2").engine.scheduler.colocated is ColocatedSchedule.CHUNKED
    spec = _spec(
        "--colocated", "2", "--colocated-schedule", "prefill-priority", "--max-num-batched-tokens", "2048"
    )
    assert spec.colocated == 2
    assert spec.engine.scheduler.colocated is ColocatedSchedule.PREFILL_PRIORITY
    assert spec.engine.scheduler.max_num_batched_tokens == 2048
