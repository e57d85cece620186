"""What structured output costs on the engine: compile, per-token mask, and batch throughput.

On SmolLM2-135M-Instruct (49,152-token vocabulary), in process (``OfflineDriver``, the colocated
engine), on this machine's CPU:

- ``compile_ms_p50``/``_max``: cold compiles (a fresh ``Grammars`` each round) of the
  real-world JSON schemas, regex and choice ``benchmarks/grammar_engines.py`` compares the
  engines on (``benchmarks/grammar_schemas.py``);
- ``mask_us_per_token_p50``/``_p99``: the sampler's grammar mask per constrained row: the time
  of each step's ``GrammarMasks.mask`` (catching every matcher up, filling the batch's bitmask)
  over the rows it masked, p99 over steps, while the batch below runs;
- ``apply_us_per_row_p50``: applying the bitmask to the logits, per row;
- ``constrained_throughput_ratio``: generated tokens/s of a batch of ``--batch`` constrained
  requests over the same batch unconstrained, same prompts, same run, alternating rounds
  (the unconstrained batch is the ceiling); every request generates exactly ``--tokens``
  tokens (the schema's array cannot close earlier; the unconstrained requests ignore EOS), so
  both batches run the same steps. ``--overlap`` repeats it with the overlapped decode loop.

    .venv/bin/python -m benchmarks.structured_output            # ~2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.common import emit
from benchmarks.grammar_schemas import cases
from pdserve.decode_worker.offline import EngineConfig, OfflineDriver
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler import SchedulerConfig
from pdserve.model_runtime.structured import matchers
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind

MODEL = "smollm2-135m"

# An array that cannot close within the run (``minItems``): every constrained request runs to
# ``max_tokens``, with objects, enums, numbers and strings along the way.
LONG = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["fruit", "vegetable", "grain"]},
            "price": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["id", "name", "kind", "price", "tags"],
        "additionalProperties": False,
    },
}


def constraints() -> list[Constraint]:
    """The engine comparison's constraints (``benchmarks/grammar_schemas.py``)."""
    return [case.constraint for case in cases()]


def compile_times(driver: OfflineDriver, rounds: int) -> list[float]:
    tok, cfg = driver.tokenizer, driver.model_config
    assert tok is not None
    warm = Grammars(tok, cfg.vocab_size, cfg.eos_token_ids)  # the engine's import and vocabulary
    warm.check(Constraint(ConstraintKind.JSON_OBJECT))
    out = []
    for _ in range(rounds):
        g = Grammars(tok, cfg.vocab_size, cfg.eos_token_ids)
        g.check(Constraint(ConstraintKind.JSON_OBJECT))  # not timed: the vocabulary, once per process
        for c in constraints():
            t0 = time.perf_counter()
            g.check(c)
            out.append((time.perf_counter() - t0) * 1e3)
        g.close()
    warm.close()
    return out


class Timed:
    """Times ``GrammarMasks.mask`` and ``matchers.apply`` per row while installed."""

    def __init__(self) -> None:
        self.mask_us: list[float] = []
        self.apply_us: list[float] = []
        self._mask, self._apply = matchers.GrammarMasks.mask, matchers.apply

    def __enter__(self) -> Timed:
        mask, apply = self._mask, self._apply

        def timed_mask(masks: Any, rows: Any, pending: Any) -> Any:
            t0 = time.perf_counter()
            out = mask(masks, rows, pending)
            if out is not None:
                self.mask_us.append((time.perf_counter() - t0) * 1e6 / len(out[0]))
            return out

        def timed_apply(logits: Any, index: list[int], bitmask: Any) -> None:
            t0 = time.perf_counter()
            apply(logits, index, bitmask)
            self.apply_us.append((time.perf_counter() - t0) * 1e6 / len(index))

        matchers.GrammarMasks.mask = timed_mask  # type: ignore[method-assign,assignment]
        matchers.apply = timed_apply
        return self

    def __exit__(self, *exc: object) -> None:
        matchers.GrammarMasks.mask = self._mask  # type: ignore[method-assign]
        matchers.apply = self._apply


def run_batch(driver: OfflineDriver, batch: int, tokens: int, constrained: bool) -> float:
    """Generated tokens/s of one batch; every request generates ``tokens`` tokens."""
    c = Constraint.json_schema(LONG) if constrained else None
    params = [
        SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=not constrained, constraint=c)
        for i in range(batch)
    ]
    prompts = [
        f"List {i + 3} grocery items as JSON with id, name, kind, price and tags." for i in range(batch)
    ]
    t0 = time.perf_counter()
    outs = driver.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    assert n == batch * tokens, f"expected {batch * tokens} tokens, got {n}"
    return n / dt


def throughput(driver: OfflineDriver, batch: int, tokens: int, rounds: int) -> dict[str, float]:
    run_batch(driver, batch, 4, True)  # the grammar compiled, matchers warm
    plain, constrained = [], []
    for _ in range(rounds):
        plain.append(run_batch(driver, batch, tokens, False))
        constrained.append(run_batch(driver, batch, tokens, True))
    ratios = [c / p for c, p in zip(constrained, plain, strict=True)]
    return {
        "unconstrained_tokens_per_s": statistics.median(plain),
        "constrained_tokens_per_s": statistics.median(constrained),
        "ratio": statistics.median(ratios),
    }


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-rounds", type=int, default=3)
    ap.add_argument("--overlap", action="store_true", help="also measure with the overlapped decode loop")
    args = ap.parse_args()
    config = EngineConfig(
        model=MODEL,
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=args.batch),
        overlap="off",
    )
    driver = OfflineDriver(config)
    compiles = compile_times(driver, args.compile_rounds)
    with Timed() as timed:
        tp = throughput(driver, args.batch, args.tokens, args.rounds)
    result: dict[str, Any] = {
        "benchmark": "structured_output",
        "model": MODEL,
        "batch": args.batch,
        "tokens": args.tokens,
        "compile_ms_p50": round(statistics.median(compiles), 2),
        "compile_ms_max": round(max(compiles), 2),
        "mask_us_per_token_p50": round(pct(timed.mask_us, 0.5), 2),
        "mask_us_per_token_p99": round(pct(timed.mask_us, 0.99), 2),
        "apply_us_per_row_p50": round(pct(timed.apply_us, 0.5), 2),
        "unconstrained_tokens_per_s": round(tp["unconstrained_tokens_per_s"], 1),
        "constrained_tokens_per_s": round(tp["constrained_tokens_per_s"], 1),
        "constrained_throughput_ratio": round(tp["ratio"], 3),
    }
    driver.check_integrity()
    if args.overlap:
        config = EngineConfig(
            model=MODEL,
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=args.batch),
            overlap="on",
        )
        over = OfflineDriver(config, overlap=True)
        o = throughput(over, args.batch, args.tokens, args.rounds)
        result["overlap_constrained_throughput_ratio"] = round(o["ratio"], 3)
    emit(result)


if __name__ == "__main__":
    main()
