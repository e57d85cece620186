"""Pure-Python schedulers: data in (requests, results), data out (plans). No torch, Ray or gRPC."""

from model_runtime.scheduler.colocated import ColocatedScheduler
from model_runtime.scheduler.decode import DecodeScheduler
from model_runtime.scheduler.plan import ScheduledChunk, SchedulePlan, SchedulerConfig, StepUpdate
from model_runtime.scheduler.prefill import PrefillScheduler

__all__ = [
    "ColocatedScheduler",
    "DecodeScheduler",
    "PrefillScheduler",
    "SchedulePlan",
    "ScheduledChunk",
    "SchedulerConfig",
    "StepUpdate",
]
