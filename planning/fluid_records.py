"""The request-level model's records (``pdserve.planning.fluid``): a request on its way
through the cluster and a worker's queue and accounts."""

from __future__ import annotations

import enum
import math
from collections import deque

from pdserve.planning.fluid_data import Role


class WorkerState(enum.Enum):
    """STARTING -> SERVING -> DRAINING -> STOPPED, or DRAINING -> STARTING in the other role
    (a switch: its start is ``switch_s``)."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class FluidRequest:
    """A request from its admission until it joins a decode batch (then it is a row of
    ``RunningDecode``) or fails."""

    __slots__ = ("arrival", "decode", "first", "granted", "kv", "output", "predicted", "prefill", "prompt")

    def __init__(
        self, arrival: float, prompt: int, output: int, prefill: FluidWorker, decode: FluidWorker
    ) -> None:
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.prefill = prefill
        self.decode = decode
        self.first = math.nan  # first token's time, once its step is closed
        self.granted = math.nan  # when its KV reservation was granted (inf: failed waiting)
        self.kv = prompt + output
        self.predicted = 0.0  # TTFT the router's queue rule predicted when it placed it (uncorrected)


class FluidWorker:
    """One GPU: a prefill worker's step queue or a decode worker's accounts (its running
    requests are ``RunningDecode``'s rows under ``index``)."""

    def __init__(self, index: int, role: Role, held_from: float, ready_at: float) -> None:
        self.index = index
        self.role = role
        self.state = WorkerState.STARTING
        self.held_from = held_from
        self.ready_at = ready_at
        self.stopped_at = math.nan
        self.retired_at = math.nan
        self.switch_to: Role | None = None
        self.gen = -1  # the tag of its entry in the prefill heap (-1: none valid)
        self.sending = 0  # prefill: prompts done whose KV has not reached their decode worker
        # prefill: the last closed step's end, and the open step (starts at ``open_start``)
        self.end = ready_at
        self.open_start = self.open_end = 0.0
        self.closed: deque[tuple[float, float, int]] = deque()  # (start, end, tokens) not yet done
        self.closed_tokens = 0
        self.open_tokens = 0
        self.open_lens: list[int] = []
        self.members: list[FluidRequest] = []
        # decode: reserved tokens, reservations waiting for room, requests joining or running
        self.reserved = 0
        self.queued = 0  # tokens of the waiting reservations
        self.waiting: deque[FluidRequest] = deque()
        self.held = 0  # requests reserved on it, not yet ended

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.SERVING
