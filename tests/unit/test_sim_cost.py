"""What a simulated point costs does not grow with its prompts' length (issue 56, item 13).

``pdserve plan`` simulates a workload at dozens of points; on a long-prompt workload (Mooncake's
conversations: 12,000 tokens a prompt) the step-by-step engines made a point's cost grow with
every prompt's chunk count. The engines' own ``step()`` now runs only where something other
than a steady step happens (a prompt's last chunk, a request joining or leaving in a way the
fast path leaves to the engine); the prompt's other chunks and the decode steps are applied
without it. So the engine steps a point takes are about the same for prompts 16 times longer.
Counted, not timed: the count is the same on any host.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import pytest

from pdserve.bench.workload import RequestSpec, arrival_times
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.prefill_worker.engine import PrefillEngine

REQUESTS = 12


def specs(prompt: int) -> list[RequestSpec]:
    """``REQUESTS`` distinct prompts of ``prompt`` tokens, 8 tokens out each, 2 req/s."""
    rng = random.Random(0)
    return [
        RequestSpec(t, tuple(rng.randrange(1000) for _ in range(prompt)), prompt, 8)
        for t in arrival_times(REQUESTS, 2.0, 1.0, rng)
    ]


def engine_steps(flags: list[str], prompt: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many times a role engine stepped itself in the run of ``flags`` on ``specs(prompt)``
    (every request completed)."""
    count = 0
    for cls in (DecodeEngine, PrefillEngine):
        real = cls.step

        def counted(self: Any, _real: Callable[[Any], Any] = real) -> Any:
            nonlocal count
            count += 1
            return _real(self)

        monkeypatch.setattr(cls, "step", counted)
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    m = simulate(p.parse_args([*flags, "--max-num-batched-tokens", "512"]), specs(prompt))
    assert m["completed"] == REQUESTS
    monkeypatch.undo()
    return count


@pytest.mark.parametrize(
    "layout",
    [["--colocated", "2"], ["--prefill", "1", "--decode", "2"]],
    ids=["colocated", "split"],
)
def test_engine_steps_do_not_grow_with_prompt_length(
    layout: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    short = engine_steps(layout, 1024, monkeypatch)  # 2 chunks of 512 a prompt
    long = engine_steps(layout, 16384, monkeypatch)  # 32 chunks a prompt
    assert long <= short
    # a few steps a request, not one a chunk (32 a prompt) or a token (8 a request)
    assert long <= 3 * REQUESTS
