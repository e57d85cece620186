"""Build a dispatcher by name (pure Python): ``goodput`` (the default), ``least_loaded``,
``round_robin``."""

from __future__ import annotations

from pdserve.router.goodput import ErrorSink, GoodputConfig, GoodputPolicy
from pdserve.router.policy import LOAD_POLICIES, POLICIES, Dispatcher, PairPolicy
from pdserve.router.predictor import StepPredictor
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.roofline import H100_LLAMA3_8B


def make_dispatcher(
    name: str,
    profile: StepTimeModel | None = None,
    block_size: int = 16,
    local_prefill: bool = True,
    on_error: ErrorSink | None = None,
    local_step_tokens: int = 0,
    prefill_step_tokens: int = 0,
    prefill_profile: StepTimeModel | None = None,
) -> Dispatcher:
    if name in LOAD_POLICIES:
        return PairPolicy(LOAD_POLICIES[name])
    if name == "goodput":
        # Without a profile the built-in one is the prior: online correction rescales it per
        # worker from the first observed request on.
        model = StepPredictor(profile or H100_LLAMA3_8B, prefill_profile=prefill_profile)
        config = GoodputConfig(
            block_size,
            local_prefill,
            local_step_tokens=local_step_tokens,
            prefill_step_tokens=prefill_step_tokens,
        )
        return GoodputPolicy(model, config, on_error)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
