"""How much of the decode engine's host work overlapped steps hide (CPU, emulated device).

The decode engine's loop does host work every step — plan the batch, launch it, read the
tokens, apply stops, build the deltas — and a device sits idle while the host does it unless the
next step is already queued. Here the device is the emulated one (``emulated:<profile>``: each
step takes the time the profile predicts, and a step launched while another runs starts when that
one ends, as on a GPU stream), so what the host adds on top shows directly:

* ``host_ms``: the loop's host work alone per step (the zero runner: no device time at all) —
  what there is to hide;
* ``device_ms``: the emulated device's time per step (the profile's prediction, summed over the
  steps measured) — the ceiling;
* ``sync_ms`` / ``overlap_ms``: the engine's wall time per step without and with overlap; their
  ratios to ``device_ms`` are the host overhead a user sees (1.0: all hidden).

Batches of 1, 16 and 64 requests decoding at a 1,024-token context, median of ``--rounds``
rounds, the two modes alternating within a round.

    .venv/bin/python -m benchmarks.overlap            # about a minute
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common import emit
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.runner import PassThroughRunner, StepHandle
from pdserve.model_runtime.engine.runtime import Runtime, StepRunner, build_runtime
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import ScheduledChunk, SchedulerConfig
from pdserve.steptime.model import StepTimeModel
from pdserve.worker.messages import WorkerRole, WorkItem


class Predicting(PassThroughRunner):
    """Passes steps through, adding up the device time the profile predicts for each."""

    def __init__(self, inner: StepRunner, profile: StepTimeModel) -> None:
        super().__init__(inner)
        self.profile = profile
        self.predicted = 0.0

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle:
        self.predicted += self.profile.step_time((c.num_tokens, c.start_pos) for c in chunks)
        return self.inner.launch(chunks, requests)


def runtime(compute: str, batch: int, ctx: int, steps: int) -> Runtime:
    blocks = batch * (-(-(ctx + steps + 64) // 16)) + 1
    return build_runtime(
        EngineConfig(
            model="tiny",
            device="cpu",
            compute=compute,
            max_model_len=ctx + steps + 64,
            cache=CacheConfig(block_size=16, num_blocks=blocks),
            scheduler=SchedulerConfig(8192, batch),
        )
    )


def per_step(rt: Runtime, overlap: bool, batch: int, ctx: int, steps: int) -> tuple[float, float]:
    """Wall seconds per decode step of the engine's loop, and the predicted device seconds."""
    profile, inner = rt.profile, rt.runner
    runner = Predicting(inner, profile) if profile is not None else None
    if runner is not None:
        rt.runner = runner
    eng = DecodeEngine(rt, None, SchedulerConfig(8192, batch), "bench", WorkerRole.COLOCATED, overlap=overlap)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_local(WorkItem(f"r{i}", tuple(3 + (i * 7 + j) % 250 for j in range(ctx)), params))
    while eng.scheduler.prefill.num_waiting or eng.scheduler.prefill.num_running:
        eng.step()
    for _ in range(3):
        eng.step()
    before = runner.predicted if runner is not None else 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0
    device = (runner.predicted - before) if runner is not None else 0.0
    while eng.has_work:
        eng.step()
    assert eng.idle and eng.kv.stats().used == 0
    if runner is not None:
        rt.runner = inner
    return wall / steps, device / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,16,64")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"profile": args.profile, "context": args.ctx, "steps": args.steps}
    for batch in (int(b) for b in args.batches.split(",")):
        emulated = runtime(f"emulated:{args.profile}", batch, args.ctx, args.steps)
        zero = runtime("zero", batch, args.ctx, args.steps)
        rounds: dict[str, list[float]] = {k: [] for k in ("host", "device", "sync", "overlap")}
        ratios: dict[str, list[float]] = {"sync": [], "overlap": []}
        for _ in range(args.rounds):
            rounds["host"].append(per_step(zero, False, batch, args.ctx, args.steps)[0])
            for overlap in (False, True):
                mode = "overlap" if overlap else "sync"
                wall, device = per_step(emulated, overlap, batch, args.ctx, args.steps)
                rounds[mode].append(wall)
                rounds["device"].append(device)
                ratios[mode].append(wall / device)
        med = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
        sync_ratio, ovl_ratio = statistics.median(ratios["sync"]), statistics.median(ratios["overlap"])
        out[f"b{batch}"] = {
            "host_ms": med["host"],
            "device_ms": med["device"],
            "sync_ms": med["sync"],
            "overlap_ms": med["overlap"],
            "sync_over_device": sync_ratio,
            "overlap_over_device": ovl_ratio,
        }
        print(
            f"batch {batch}: host {med['host']:.3f} ms, device {med['device']:.3f} ms, "
            f"sync {med['sync']:.3f} ms ({sync_ratio:.3f}x), "
            f"overlap {med['overlap']:.3f} ms ({ovl_ratio:.3f}x)",
            flush=True,
        )
    emit(out)


if __name__ == "__main__":
    main()
