"""Which grammar engine masks SmolLM2's 49k vocabulary fastest: xgrammar, llguidance, outlines-core.

Issue 60 asks for the structured-output engine to be picked by measurement on this CPU. Each
engine compiles the constraints of ``benchmarks/grammar_schemas.py`` (eight real-world JSON
schemas, a regex, a choice list) against SmolLM2-135M-Instruct's tokenizer and then walks
documents that conform, token by token as the model's tokenizer splits them:

- compile: a fresh compiler and no cache each time (median of ``--repeat``; outlines-core once,
  in a child process killed after ``--outlines-timeout`` seconds, reported as "> N s");
- mask: the time to fill one row's bitmask before each token and before EOS at the end, on
  the first matcher after the compile (cold) and on a second one (warm); every token must be in
  the mask and be accepted, and EOS must be allowed at the end (else a failure is reported);
- batch: 32 matchers at different points of their documents, over one schema and over all the
  constraints, the time to fill a [32, words] bitmask per step (xgrammar's BatchGrammarMatcher,
  llguidance's LLExecutor, outlines-core's per-guide lookups), one thread each (``--threads``).

Every engine reads the same documents: separators ``", "`` and ``": "``, no other whitespace,
keys in the canonical schema's order, as the project's compiler (xgrammar, ``any_whitespace``
off, strict) expects.

    nice -n 15 .venv/bin/python -m benchmarks.grammar_engines     # about two minutes

Final JSON line: per engine ``compile_ms_p50``, ``compile_ms_max``, ``compile_timeouts``,
``mask_us_p50`` / ``mask_us_p99`` / ``mask_us_max`` (warm), ``cold_mask_us_*``,
``batch32_fill_us_p50`` (one schema), ``batch32_mixed_fill_us_p50``, ``failures``; and
``chosen`` with the reason computed from them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jsonschema
import torch

from benchmarks.common import emit
from benchmarks.grammar_adapters import ENGINES, Engine, Vocab
from benchmarks.grammar_schemas import Case, cases
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.structured.constraint import check_constraint
from pdserve.model_runtime.tokenizer import TextTokenizer

BATCH = 32


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def encode(tt: TextTokenizer, case: Case) -> list[list[int]]:
    """Each document's tokens as the model's tokenizer splits it (checked to round-trip)."""
    out = []
    for doc in case.documents:
        ids = tt.backend.encode(doc, add_special_tokens=False).ids
        if tt.backend.decode(ids, skip_special_tokens=False) != doc:
            raise SystemExit(f"{case.name}: the tokenizer does not round-trip {doc!r}")
        out.append(ids)
    return out


def check_cases(all_cases: list[Case]) -> None:
    """The documents really conform (a benchmark of wrong documents would measure refusals)."""
    for case in all_cases:
        check_constraint(case.constraint)
        if case.schema is not None:
            for doc in case.documents:
                jsonschema.validate(
                    json.loads(doc),
                    case.schema,
                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
                )


def has_bit(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def walk(engine: Engine, compiled: Any, matcher: Any, ids: list[int], eos: int, times: list[float]) -> str:
    """Mask before each token and before EOS, appending microseconds to ``times``; '' or why
    the document was refused."""
    row = engine.bitmask(1)
    clock = time.perf_counter_ns
    for k, t in enumerate([*ids, eos]):
        row.fill_(0)
        t0 = clock()
        engine.fill(matcher, row)
        times.append((clock() - t0) / 1e3)
        if not has_bit(row[0], t):
            return f"token {k} ({'EOS' if k == len(ids) else t}) not in the mask"
        if k < len(ids) and not engine.accept(matcher, t):
            return f"token {k} ({t}) refused"
    return ""


def batch_steps(engine: Engine, compiled: list[tuple[Any, list[int]]], steps: int, eos: int) -> list[float]:
    """Per step, microseconds to fill [32, words] for 32 matchers spread over their documents."""
    slots: list[tuple[Any, int, Any, list[int]]] = []  # matcher, position, compiled, tokens
    for j in range(BATCH):
        g, ids = compiled[j % len(compiled)]
        m = engine.matcher(g)
        pos = (j * 7) % len(ids)
        for t in ids[:pos]:
            engine.accept(m, t)
        slots.append((m, pos, g, ids))
    bitmask = engine.bitmask(BATCH)
    times = []
    clock = time.perf_counter_ns
    for _ in range(steps):
        t0 = clock()
        engine.batch_fill([s[0] for s in slots], bitmask)
        times.append((clock() - t0) / 1e3)
        for j, (m, pos, g, ids) in enumerate(slots):
            if pos == len(ids):  # ended: a new request with the same constraint takes the slot
                slots[j] = (engine.matcher(g), 0, g, ids)
            else:
                engine.accept(m, ids[pos])
                slots[j] = (m, pos + 1, g, ids)
    return times


def measure(
    engine: Engine, all_cases: list[Case], tokens: dict[str, list[list[int]]], args: Any
) -> dict[str, Any]:
    compile_ms: dict[str, float | str] = {}
    cold: list[float] = []
    warm: list[float] = []
    first: list[float] = []
    failures: list[str] = []
    compiled: dict[str, Any] = {}
    eos = engine.vocab.eos_ids[0]
    for case in all_cases:
        try:
            ms, g = engine.compile_timed(case.constraint, args.repeat)
        except TimeoutError as e:
            compile_ms[case.name] = f"> {e} s"
            continue
        except Exception as e:
            compile_ms[case.name] = "refused"
            failures.append(f"{case.name}: does not compile: {str(e).strip().splitlines()[-1][:200]}")
            continue
        compile_ms[case.name] = round(ms, 2)
        compiled[case.name] = g
        gc.disable()
        try:
            for d, ids in enumerate(tokens[case.name]):
                for pass_, times in (("cold", cold), ("warm", warm)):
                    one: list[float] = []
                    why = walk(engine, g, engine.matcher(g), ids, eos, one)
                    if d == 0 and pass_ == "cold" and one:
                        first.append(one[0])
                    times.extend(one)
                    if why:
                        failures.append(f"{case.name} document {d} ({pass_}): {why}")
        finally:
            gc.enable()
        print(f"{engine.name} {case.name}: compile {compile_ms[case.name]} ms", flush=True)
    done = [v for v in compile_ms.values() if isinstance(v, float)]
    ok = [(compiled[c.name], tokens[c.name][0]) for c in all_cases if c.name in compiled]
    head = all_cases[0].name
    same = [(compiled[head], tokens[head][0])] if head in compiled else []
    out: dict[str, Any] = {
        "compile_ms": compile_ms,
        "compile_ms_p50": round(statistics.median(done), 2) if done else None,
        "compile_ms_max": round(max(done), 2) if done else None,
        "compile_timeouts": [k for k, v in compile_ms.items() if isinstance(v, str) and v.startswith(">")],
        "first_mask_us_max": round(max(first), 1) if first else None,
        "failures": failures,
    }
    for prefix, times in (("", warm), ("cold_", cold)):
        if times:
            out[f"{prefix}mask_us_p50"] = round(pct(times, 0.5), 2)
            out[f"{prefix}mask_us_p99"] = round(pct(times, 0.99), 2)
            out[f"{prefix}mask_us_max"] = round(max(times), 1)
    gc.disable()
    try:
        for key, group in (("batch32_fill_us", same), ("batch32_mixed_fill_us", ok)):
            if group:
                steps = batch_steps(engine, group, args.steps, eos)
                out[f"{key}_p50"] = round(statistics.median(steps), 1)
                out[f"{key}_p99"] = round(pct(steps, 0.99), 1)
    finally:
        gc.enable()
    return out


def choose(results: dict[str, dict[str, Any]], n_cases: int) -> dict[str, str]:
    """The engine with the lowest warm mask p99 among those that compile every constraint
    within 1 s and walk every document."""
    fit = {
        name: r
        for name, r in results.items()
        if not r["failures"]
        and not r["compile_timeouts"]
        and len([v for v in r["compile_ms"].values() if isinstance(v, float)]) == n_cases
        and r["compile_ms_max"] is not None
        and r["compile_ms_max"] < 1000
    }
    if not fit:
        return {
            "chosen": "",
            "reason": "no engine compiles every constraint under 1 s and walks every document",
        }
    best = min(fit, key=lambda n: fit[n]["mask_us_p99"])
    others = ", ".join(f"{n} {r.get('mask_us_p99')}" for n, r in results.items() if n != best)
    unfit = sorted(set(results) - set(fit))
    return {
        "chosen": best,
        "reason": (
            f"lowest warm mask p99 ({fit[best]['mask_us_p99']} us; {others}) among engines that compile "
            f"all {n_cases} constraints under 1 s and accept every document"
            + (f" (not: {', '.join(unfit)})" if unfit else "")
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="compiles per constraint (not outlines-core)")
    ap.add_argument("--steps", type=int, default=64, help="batch steps timed")
    ap.add_argument("--threads", type=int, default=1, help="threads of the batch fills")
    ap.add_argument("--outlines-timeout", type=float, default=20.0, help="seconds per outlines-core compile")
    args = ap.parse_args()
    ck = resolve_model(args.model)
    tt = TextTokenizer.load(ck)
    if tt is None:
        raise SystemExit(f"{args.model} ships no tokenizer")
    cfg = ck.model_config()
    vocab = Vocab(tt, cfg.vocab_size, tuple(sorted(set(cfg.eos_token_ids))))
    all_cases = cases()
    check_cases(all_cases)
    tokens = {c.name: encode(tt, c) for c in all_cases}
    results: dict[str, dict[str, Any]] = {}
    factories: dict[str, Callable[..., Engine]] = ENGINES
    for name in args.engines.split(","):
        engine = factories[name](vocab, threads=args.threads, timeout_s=args.outlines_timeout)
        try:
            results[name] = measure(engine, all_cases, tokens, args)
        finally:
            engine.close()
        r = results[name]
        print(
            f"{name}: compile p50 {r['compile_ms_p50']} ms max {r['compile_ms_max']} ms "
            f"(timeouts {r['compile_timeouts']}); mask p50 {r.get('mask_us_p50')} us p99 "
            f"{r.get('mask_us_p99')} us max {r.get('mask_us_max')} us "
            f"(cold p99 {r.get('cold_mask_us_p99')}); "
            f"batch-32 fill {r.get('batch32_fill_us_p50')} us (mixed {r.get('batch32_mixed_fill_us_p50')}); "
            f"{len(r['failures'])} failures",
            flush=True,
        )
        for f in r["failures"]:
            print(f"  failure: {f}", flush=True)
    out: dict[str, Any] = {
        "model": args.model,
        "vocab_size": cfg.vocab_size,
        "constraints": [c.name for c in all_cases],
        "tokens_walked": sum(len(t) + 1 for ts in tokens.values() for t in ts),
        "threads": args.threads,
        **results,
    }
    out.update(choose(results, len(all_cases)))
    emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
