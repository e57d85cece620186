"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from pdserve.flags import (
    DEFAULT_MODEL,
    add_block_size,
    add_model,
    add_scheduler,
    add_temperature,
    int_at_least,
)
from pdserve.model_runtime.errors import PdserveError

DEMO_PROMPTS = (
    "Disaggregated serving splits prefill and decode because",
    "The quick brown fox",
    "Goodput is the highest request rate at which",
)


def _engine_args(p: argparse.ArgumentParser) -> None:
    add_model(p, DEFAULT_MODEL)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)"
    )
    add_block_size(p, 16)
    add_scheduler(p)


def _build_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import torch

    from pdserve.decode_worker.offline import OfflineDriver
    from pdserve.model_runtime.backend import step_sizes
    from pdserve.model_runtime.config import CacheConfig, EngineConfig
    from pdserve.model_runtime.scheduler.plan import SchedulerConfig

    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    tokens, seqs = step_sizes(on_gpu, args.max_num_batched_tokens, args.max_num_seqs)
    return OfflineDriver(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            cache=CacheConfig(block_size=args.block_size),
            scheduler=SchedulerConfig(max_num_batched_tokens=tokens, max_num_seqs=seqs),
        )
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.model_runtime.platform import use_threads
    from pdserve.model_runtime.sampling_params import SamplingParams

    threads = use_threads(args.threads)
    t0 = time.perf_counter()
    engine = _build_engine(args)
    print(
        f"loaded {args.model} in {time.perf_counter() - t0:.2f}s "
        f"({engine.model_config.architecture}, {engine.model_config.num_parameters() / 1e6:.1f}M params, "
        f"{threads} thread{'s' if threads > 1 else ''})"
    )
    prompts: list[str | list[int]] = list(args.prompt or DEMO_PROMPTS)
    if args.token_ids:
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    params = SamplingParams.create(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_tok = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        n_tok += len(out.token_ids)
        print(f"\n>>> {prompt!r}")
        print(f"    text: {out.text!r}" if out.text is not None else "    (no tokenizer)")
        print(f"    tokens: {out.token_ids}")
        print(f"    finish: {out.finish_reason.openai if out.finish_reason else None}, usage: {out.usage}")
    print(f"\n{len(prompts)} requests, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.0f} tok/s)")
    engine.check_integrity()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.serve import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation on one colocated engine")
    _engine_args(g)
    g.add_argument("prompt", nargs="*", help="prompts (default: a few demo prompts)")
    g.add_argument("--token-ids", action="store_true", help="prompts are comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=32)
    add_temperature(g)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument(
        "--threads",
        type=int_at_least(0),
        default=1,
        help="torch threads: 1 (default) as a serving worker gets (--cpus-per-worker); 0: every CPU "
        "this process may use (its affinity and cgroup quota); more threads than idle cores make "
        "each step wait on the busiest",
    )
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="run the cluster: router (gRPC + OpenAI HTTP) and worker pools")
    _engine_args(s)
    from pdserve.serve import add_serve_args

    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="open-loop load test of any OpenAI-compatible or pdserve endpoint")
    from pdserve.bench.runner import add_bench_args, cmd_bench

    add_bench_args(b)
    b.set_defaults(func=cmd_bench)
    m = sub.add_parser("simulate", help="discrete-event simulation of a cluster (the real schedulers)")
    from pdserve.planning.simulate import add_simulate_args, cmd_simulate

    add_simulate_args(m)
    m.set_defaults(func=cmd_simulate)
    pl = sub.add_parser("plan", help="the layout of N GPUs with the most goodput per GPU (simulated)")
    from pdserve.planning.plan import add_plan_args, cmd_plan

    add_plan_args(pl)
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("profile", help="measure the engine on this machine and fit a latency profile (JSON)")
    from pdserve.profile import add_profile_args, cmd_profile

    add_profile_args(pr)
    pr.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except PdserveError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
