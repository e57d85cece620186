"""Pure-Python schedulers: data in (requests, results), data out (plans). No torch, Ray or gRPC."""

from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
from pdserve.model_runtime.scheduler.decode import DecodeScheduler
from pdserve.model_runtime.scheduler.plan import ScheduledChunk, SchedulePlan, SchedulerConfig, StepUpdate
from pdserve.model_runtime.scheduler.prefill import PrefillScheduler

__all__ = [
    "ColocatedScheduler",
    "DecodeScheduler",
    "PrefillScheduler",
    "SchedulePlan",
    "ScheduledChunk",
    "SchedulerConfig",
    "StepUpdate",
]
