"""Any step-time model at a tensor-parallel degree (pure Python).

A degree is part of a worker's identity: the simulator, the emulated workers, the router's
predictor and the planner all take a model *at* a degree and use it unchanged. The roofline
models any degree (``RooflineProfile.at_tp``); a wrapper (time dilation, a host calibration)
passes the degree to what it wraps; a fitted profile was measured at one degree and is only
that one (fit another with ``pdserve profile`` on workers of that degree).
"""

from __future__ import annotations

import dataclasses

from pdserve.steptime.model import StepTimeModel, Wrapper
from pdserve.steptime.roofline import RooflineProfile


def tp_of(model: StepTimeModel) -> int:
    """The GPUs a worker of ``model`` spans."""
    if isinstance(model, RooflineProfile):
        return model.tp
    if isinstance(model, Wrapper):
        return tp_of(model.base)
    return 1


def valid_tp(model: StepTimeModel) -> tuple[int, ...]:
    """The degrees ``model`` runs at (smallest first)."""
    if isinstance(model, RooflineProfile):
        return model.valid_tp()
    if isinstance(model, Wrapper):
        return valid_tp(model.base)
    return (tp_of(model),)


def at_tp(model: StepTimeModel, tp: int) -> StepTimeModel:
    """``model`` on workers of ``tp`` GPUs; ``ValueError`` naming the valid degrees where it
    does not run at ``tp``."""
    if isinstance(model, RooflineProfile):
        return model.at_tp(tp)
    if isinstance(model, Wrapper) and dataclasses.is_dataclass(model):
        base = at_tp(model.base, tp)
        return model if base is model.base else dataclasses.replace(model, base=base)
    if tp != tp_of(model):
        raise ValueError(
            f"{model.name} was measured at tp={tp_of(model)} and is only that degree: fit a profile "
            f"on workers of {tp} GPUs (pdserve profile)"
        )
    return model


def at_degree(model: StepTimeModel, tp: int) -> StepTimeModel:
    """A pool's model: ``model`` at the pool's degree when that is above 1; at degree 1 the
    model as named (a profile named ``…@tpN`` keeps its own)."""
    return at_tp(model, tp) if tp > 1 else model
