"""Overlapped decode on the real model (CPU): the step ahead reads its inputs from the previous
step's sampled tokens on the device, and every sampler feature that looks at a request's
history (seeded draws, penalties, ``min_tokens``, stop ids, logprobs) must see the token still
in flight, so the engine's output is exactly the synchronous engine's, on both backends."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.runner import PassThroughRunner
from pdserve.model_runtime.engine.runtime import Runtime, build_runtime
from pdserve.model_runtime.kv_cache.manager import check_idle
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.worker.messages import WorkerRole, WorkItem

PARAMS = [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=11, logprobs=3),
    SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=5, repetition_penalty=1.3),
    SamplingParams(max_tokens=10, temperature=1.0, seed=2, frequency_penalty=0.6, presence_penalty=0.4),
    SamplingParams(max_tokens=15, temperature=0, min_tokens=6, logprobs=0),
    SamplingParams(max_tokens=40, temperature=1.2, seed=9, min_p=0.05),
]


def runtime(backend: str, device: str = "cpu", dtype: str | None = None) -> Runtime:
    return build_runtime(
        EngineConfig(
            model="tiny",
            device=device,
            dtype=dtype,
            backend=backend,
            cache=CacheConfig(block_size=8, num_blocks=64),
            scheduler=SchedulerConfig(64, 8),
        )
    )


class CountingRunner(PassThroughRunner):
    """Counts the rows the engine ran ahead (pending inputs)."""

    pending_rows = 0

    def launch(self, chunks, requests):  # type: ignore[no-untyped-def]
        self.pending_rows += sum(c.pending for c in chunks)
        return self.inner.launch(chunks, requests)


def prompt(i: int) -> tuple[int, ...]:
    return tuple((i * 37 + j * 11) % 250 + 1 for j in range(5 + 9 * i))


def generate(rt: Runtime, overlap: bool, stop_id: int | None = None) -> tuple[dict[str, list], int]:  # type: ignore[type-arg]
    counting = CountingRunner(rt.runner)
    rt.runner = counting
    eng = DecodeEngine(rt, None, SchedulerConfig(64, 8), "w", WorkerRole.COLOCATED, overlap=overlap)
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for i, p in enumerate(PARAMS):
        eng.add_local(WorkItem(f"r{i}", prompt(i), p))
        out[f"r{i}"] = []
    if stop_id is not None:  # r0's prompt again, ended by a stop id it meets: seen one step late
        stop = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop_id,))
        eng.add_local(WorkItem("stop", prompt(0), stop))
        out["stop"] = []
    steps = 0
    while eng.has_work:
        for d in eng.step():
            out[d.request_id].append((d.token_ids, d.logprobs, d.finished, d.finish_reason, d.stop_token_id))
        steps += 1
        assert steps < 500
    assert eng.idle
    check_idle(eng.kv, True, eng.request_state())
    return out, counting.pending_rows


def flat(deltas: list) -> tuple:  # type: ignore[type-arg]
    tokens = [t for d in deltas for t in d[0]]
    logprobs = [lp for d in deltas for lp in (d[1] or ())]
    return tokens, logprobs, deltas[-1][2:]


def check_overlap_matches(make: Callable[[], Runtime]) -> None:
    """``make``'s engine gives the same output overlapped as synchronous (also run on CUDA by
    ``test_gpu.py``)."""
    first, _ = generate(make(), overlap=False)
    greedy = flat(first["r0"])[0]
    stop_id = greedy[6]
    sync, _ = generate(make(), overlap=False, stop_id=stop_id)
    ahead, pending_rows = generate(make(), overlap=True, stop_id=stop_id)
    assert pending_rows > 30
    assert sync.keys() == ahead.keys()
    for rid in sync:
        assert flat(ahead[rid]) == flat(sync[rid]), rid
    tokens, _, (_, reason, stopped_by) = flat(sync["stop"])
    assert (reason, stopped_by) == ("stop", stop_id) and tokens == greedy[: greedy.index(stop_id) + 1]


@pytest.mark.parametrize("backend", ["torch", "paged"])
def test_overlapped_decode_gives_the_synchronous_output(backend: str) -> None:
    check_overlap_matches(lambda: runtime(backend))
