"""``pdserve profile``: measure the real engine on this machine and fit a latency profile.

What is measured, all with the engine's whole ``step()`` (scheduling, batch building, forward
pass, sampling, output processing) on ``--threads`` torch threads — a serving worker gets one
thread per CPU it is given (``--cpus-per-worker``), so profile with the same count:

* prefill: one prompt of each length in ``--prefill-lens``, a few packed batches of several
  prompts, and continuing chunks (a prompt run in chunks of ``--chunk`` tokens, each after the
  previous ones are cached); the median of ``--repeat`` runs per shape, after a warm-up;
* decode: for each context length in ``--decode-contexts``, the batch grows through
  ``--decode-batches`` (new requests prefilled in between); at each size the median of
  ``--decode-steps`` decode-only steps. The steps that prefill the newcomers while the others
  decode are the mixed steps against which the additive rule is checked;
* the KV hand-off: whole transfers between two ``KVTransport`` instances over the worker's
  transport (``--link shm`` or ``tcp``; in one process, separate threads and sockets), several
  sizes, fitted to latency + bytes / bandwidth. ``--link-gbps`` skips this and takes a figure.

The fit is ``pdserve.steptime.fitted.FittedProfile.fit``: DistServe's form (prefill a + b·Σl +
c·Σl², decode a + b·Σctx + c·B) by relative-error least squares with non-negative coefficients.
Each point's relative error and the fit's median and maximum are printed; the profile is written
as JSON (``--output``) that ``pdserve simulate --profile`` and ``--compute emulated:`` load.

Requests are made of random token ids with prefix caching off, so every token is computed.
Decode steps run over whatever KV the prefills wrote: a step's cost does not depend on the
values.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.flags import add_block_size, add_model

Shape = tuple[tuple[int, int], ...]  # (new tokens, cached tokens) per chunk of a step
Point = tuple[Shape, float]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_profile_args(p: argparse.ArgumentParser) -> None:
    add_model(p, "bench")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's --cpus-per-worker)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU)")
    add_block_size(p, 16)
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=256,
        help="the serving worker's pool (pdserve serve's flag): the profile's KV capacity",
    )
    p.add_argument("--prefill-lens", type=_ints, default=_ints("16,32,64,128,256,384,512,768,1024,1536"))
    p.add_argument("--chunk", type=int, default=512, help="chunk size of the continuing-chunk points")
    p.add_argument("--decode-batches", type=_ints, default=_ints("1,2,4,8,16,32"))
    p.add_argument("--decode-contexts", type=_ints, default=_ints("64,256,768"))
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--repeat", type=int, default=5, help="runs per prefill shape (median)")
    p.add_argument(
        "--link", choices=("shm", "tcp"), default="shm", help="transport measured for the hand-off"
    )
    p.add_argument("--link-gbps", type=float, default=None, help="take this link bandwidth (GB/s) instead")
    p.add_argument(
        "--link-latency-us", type=float, default=100.0, help="with --link-gbps: fixed cost per transfer"
    )
    p.add_argument("--name", default=None, help="profile name (default: cpu-<model>-<threads>t)")
    p.add_argument("--output", type=Path, default=None, help="JSON path (default: <name>.json)")
    p.add_argument("--seed", type=int, default=0)


PACKED = ((2, 256), (4, 128), (8, 64), (4, 256), (2, 512))  # (requests, prompt tokens) per batch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Meter:
    """The colocated engine's ``step()`` (through its ``OfflineDriver``), timed, with the shape
    of what its runner ran."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.shape: Shape = ()
        inner = engine.runner.launch

        def recording(chunks: Sequence[Any], requests: Mapping[str, Any]) -> Any:
            self.shape = tuple((c.num_tokens, c.start_pos) for c in chunks)
            return inner(chunks, requests)

        engine.runner.launch = recording  # an instance attribute: only this engine records
        self.rng = random.Random(0)
        self.n = 0

    def configure(self, budget: int, max_seqs: int = 256) -> None:
        """A fresh scheduler with this token budget (only between measurements: no requests)."""
        from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
        from pdserve.model_runtime.scheduler.plan import SchedulerConfig

        assert not self.engine.has_unfinished
        self.engine.engine.scheduler = ColocatedScheduler(
            self.engine.kv, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
        )

    def add(self, prompt_len: int, max_tokens: int) -> str:
        from pdserve.model_runtime.sampling_params import SamplingParams

        self.n += 1
        rid = f"profile-{self.n}"
        prompt = [self.rng.randrange(16, self.engine.model_config.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def step(self) -> Point:
        self.shape = ()
        t0 = time.perf_counter()
        self.engine.step()
        return self.shape, time.perf_counter() - t0

    def drop_all(self) -> None:
        for rid in self.engine.request_ids:
            self.engine.abort(rid)


def is_decode(shape: Shape) -> bool:
    return bool(shape) and all(n == 1 and c > 0 for n, c in shape)


def is_prefill(shape: Shape) -> bool:
    return bool(shape) and not any(n == 1 and c > 0 for n, c in shape)


def describe(shape: Shape) -> str:
    dec = [c for n, c in shape if n == 1 and c > 0]
    pre = [(n, c) for n, c in shape if not (n == 1 and c > 0)]
    parts = []
    if pre:
        lens = sorted({n for n, _ in pre})
        cached = sorted({c for _, c in pre})
        what = (
            f"{len(pre)}x{lens[0]}" if len(lens) == 1 else f"{len(pre)} chunks, {sum(n for n, _ in pre)} tok"
        )
        parts.append(f"prefill {what}" + (f" after {cached[-1]}" if cached[-1] else ""))
    if dec:
        parts.append(f"decode B={len(dec)} ctx={sum(dec) + len(dec)}")
    return " + ".join(parts)


def median_point(points: list[Point]) -> Point:
    """The measurement of median time (its own shape: decode contexts grow step by step)."""
    ordered = sorted(points, key=lambda p: p[1])
    return ordered[len(ordered) // 2]


def measure_prefill(m: Meter, args: argparse.Namespace) -> list[Point]:
    out: list[Point] = []
    shapes: list[tuple[int, int]] = [(1, n) for n in args.prefill_lens] + list(PACKED)
    m.configure(budget=max(max(k * n for k, n in shapes), args.chunk))
    for _ in range(3):  # warm-up
        m.add(64, 1)
        m.step()
        m.drop_all()
    runs: dict[tuple[int, int], list[Point]] = {sh: [] for sh in shapes}
    for _ in range(args.repeat):  # round robin: a slow spell of this noisy host hits every shape once
        for k, n in shapes:
            for _ in range(k):
                m.add(n, 1)
            runs[(k, n)].append(m.step())
            m.drop_all()
    for k, n in shapes:
        pt = median_point(runs[(k, n)])
        out.append(pt)
        log(f"  {describe(pt[0]):<40} {pt[1] * 1000:9.2f} ms")
    # Continuing chunks: a prompt of 3 chunks, each after the previous ones are cached.
    m.configure(budget=args.chunk)
    by_step: list[list[Point]] = [[], [], []]
    for _ in range(args.repeat):
        m.add(3 * args.chunk, 1)
        for i in range(3):
            by_step[i].append(m.step())
        m.drop_all()
    for step_runs in by_step[1:]:  # the first chunk (nothing cached) is the plain prefill above
        pt = median_point(step_runs)
        out.append(pt)
        log(f"  {describe(pt[0]):<40} {pt[1] * 1000:9.2f} ms")
    return out


def measure_decode(m: Meter, args: argparse.Namespace) -> tuple[list[Point], list[Point]]:
    """Decode-only points (one per batch size and context) and the mixed steps in between."""
    decode: list[Point] = []
    mixed: list[Point] = []
    batches = sorted(set(args.decode_batches))
    steps_per_phase = len(batches) * (args.decode_steps + 4) + 64
    for ctx in args.decode_contexts:
        m.configure(budget=max(batches) * ctx + max(batches))
        running = 0
        for b in batches:
            for _ in range(b - running):
                m.add(ctx, steps_per_phase)
            running = b
            while True:  # prefill the newcomers (with the others decoding: mixed steps)
                pt = m.step()
                if is_decode(pt[0]):
                    break
                if not is_prefill(pt[0]):
                    mixed.append(pt)
            runs = [m.step() for _ in range(args.decode_steps)]
            assert all(is_decode(s) and len(s) == b for s, _ in runs), "decode steps changed shape"
            pt = median_point(runs)
            decode.append(pt)
            log(f"  {describe(pt[0]):<40} {pt[1] * 1000:9.2f} ms")
        # The service's shape of mixed step: a long prompt in chunks while the batch decodes.
        m.drop_all()
    m.configure(budget=args.chunk)
    for b in (4, 16):
        for _ in range(b):
            m.add(256, 64)
        while not is_decode(m.step()[0]):
            pass
        m.add(2 * args.chunk, 1)
        for _ in range(3):
            pt = m.step()
            if not is_decode(pt[0]) and not is_prefill(pt[0]):
                mixed.append(pt)
        m.drop_all()
    return decode, mixed


def measure_link(args: argparse.Namespace, layout: tuple[int, ...], dtype: Any) -> tuple[float, float, str]:
    """(latency s, bandwidth bytes/s, how) of whole KV transfers over the real transport."""
    if args.link_gbps is not None:
        return args.link_latency_us * 1e-6, args.link_gbps * 1e9, f"given: {args.link_gbps} GB/s"
    import torch

    from pdserve.kvtransfer.config import TransportConfig
    from pdserve.kvtransfer.datapath import allocate_shared_kv_cache
    from pdserve.kvtransfer.states import TransferState
    from pdserve.kvtransfer.transport import KVTransport
    from pdserve.model_runtime.kv_cache.tensors import new_kv_cache
    from pdserve.steptime.fitted import fit_relative

    secret = os.urandom(32)
    blocks = layout[1]
    src = new_kv_cache(layout, dtype)  # the workers' storage order, or the handshake refuses it
    src.copy_(torch.randn(layout))
    dst, path = allocate_shared_kv_cache(layout, dtype)
    cfg = TransportConfig(backend=args.link)
    sender, receiver = KVTransport(src, secret, cfg), KVTransport(dst, secret, cfg, shm_path=path)
    per_block = src[:, 0].numel() * src.element_size()
    rows, ys = [], []
    try:
        addr = receiver.listen()
        n = 0
        for nb in (1, 8, 32, min(128, blocks), min(256, blocks)):
            times = []
            for rep in range(7):
                ids = list(range(nb))
                tid = f"link-{n}"
                n += 1
                t0 = time.perf_counter()
                receiver.expect(tid, ids)
                sender.send(tid, addr, ids, ids)
                deadline = t0 + 60
                while (state := receiver.wait(tid, 0.05)) is not TransferState.DONE:
                    # Either side may see a failure first (a refused sender fails at once while
                    # the receiver would wait out its lease; a failed receiver ends the wait).
                    failed = TransferState.FAILED in (state, sender.state(tid))
                    if failed or time.perf_counter() > deadline:
                        raise RuntimeError(f"{args.link} transfer failed while profiling the link")
                dt = time.perf_counter() - t0
                receiver.forget(tid)
                if rep >= 2:  # two warm-ups
                    times.append(dt)
            t = statistics.median(times)
            rows.append((1.0, float(nb * per_block)))
            ys.append(t)
            log(f"  {args.link} {nb:4d} blocks ({nb * per_block / 2**20:7.2f} MiB) {t * 1000:8.3f} ms")
    finally:
        sender.close()
        receiver.close()
        path.unlink(missing_ok=True)
    lat, inv_bw = fit_relative(rows, ys)
    bw = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    return lat, bw, f"{args.link} between two KVTransports in one process, whole transfers"


def report(name: str, profile: Any, points: list[Point]) -> list[float]:
    from pdserve.steptime.fitted import relative_errors

    errs = relative_errors(profile, points)
    print(f"\n{name}: {len(points)} points")
    print(f"  {'shape':<44} {'measured':>10} {'model':>10} {'error':>8}")
    for (shape, t), e in zip(points, errs, strict=True):
        model = profile.step_time(shape) * 1000
        print(f"  {describe(shape):<44} {t * 1000:8.2f}ms {model:8.2f}ms {e * 100:+7.1f}%")
    if errs:
        a = [abs(e) for e in errs]
        print(f"  |error| median {statistics.median(a) * 100:.1f}%, max {max(a) * 100:.1f}%")
    return errs


def profile_engine(args: argparse.Namespace, progress: Callable[[str], None] = log) -> dict[str, Any]:
    """Measure, fit, print; returns the profile and what it was fitted on."""
    import torch

    from pdserve.decode_worker.offline import OfflineDriver
    from pdserve.model_runtime.config import CacheConfig, EngineConfig
    from pdserve.model_runtime.kv_cache.tensors import kv_cache_shape
    from pdserve.model_runtime.model.loader import resolve_dtype
    from pdserve.model_runtime.platform import use_threads
    from pdserve.steptime.fitted import FittedProfile

    use_threads(args.threads)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    dtype_bytes = torch.finfo(dtype).bits // 8
    b_max, c_max = max(args.decode_batches), max(args.decode_contexts)
    tokens = max(b_max * (c_max + len(args.decode_batches) * (args.decode_steps + 4) + 80),
                 3 * args.chunk, max(args.prefill_lens), *(k * n for k, n in PACKED)) + 4096  # fmt: skip
    t0 = time.perf_counter()
    engine = OfflineDriver(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=-(-tokens // args.block_size),
                enable_prefix_caching=False,
            ),
        )
    )
    mc = engine.model_config
    took = time.perf_counter() - t0
    progress(
        f"loaded {args.model} ({mc.num_parameters() / 1e6:.1f}M params) in {took:.1f}s, "
        f"{args.threads} thread(s)"
    )
    m = Meter(engine)
    progress("prefill:")
    prefill = measure_prefill(m, args)
    progress("decode (batch x context):")
    decode, mixed = measure_decode(m, args)
    engine.check_integrity()
    progress("KV hand-off:")
    layout = kv_cache_shape(mc, 256, args.block_size)
    lat, bw, how = measure_link(args, layout, dtype)
    serve_blocks = CacheConfig(
        block_size=args.block_size, memory_budget_bytes=args.kv_cache_mib << 20
    ).resolve_num_blocks(mc, dtype_bytes)
    name = args.name or f"cpu-{Path(args.model).name}-{args.threads}t"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    source = (
        f"pdserve profile --model {args.model} --threads {args.threads} --kv-cache-mib {args.kv_cache_mib}; "
        f"{cpu}, torch {torch.__version__}, {datetime.now():%Y-%m-%d %H:%M}; link: {how}"
    )
    prof = FittedProfile.fit(
        name, prefill, decode,
        link_latency_s=lat, link_bw=bw, kv_bytes_per_token=mc.kv_bytes_per_token(dtype_bytes),
        kv_capacity_tokens=serve_blocks * args.block_size, max_model_len=engine.max_model_len, source=source,
    )  # fmt: skip
    report("prefill steps (fitted)", prof, prefill)
    report("decode steps (fitted)", prof, decode)
    mixed_err = report("mixed steps (not fitted: prefill + decode part, charged additively)", prof, mixed)
    a, b, c = prof.prefill_coefficients
    print(f"\nprefill: {a * 1e3:.3f} ms + {b * 1e6:.2f} us/token + {c * 1e9:.4f} ns * l(l+2c)")
    a, b, c = prof.decode_coefficients
    print(f"decode:  {a * 1e3:.3f} ms + {b * 1e9:.2f} ns/context token + {c * 1e6:.2f} us/request")
    print(f"link:    {prof.link_latency_s * 1e6:.0f} us + bytes / {prof.link_bw / 1e9:.2f} GB/s ({how})")
    kv = f"{prof.kv_bytes_per_token} B/token, {prof.kv_capacity_tokens} tokens in {args.kv_cache_mib} MiB"
    print(f"KV:      {kv}")
    return {"profile": prof, "prefill": prefill, "decode": decode, "mixed": mixed, "mixed_errors": mixed_err}


def cmd_profile(args: argparse.Namespace) -> int:
    if args.threads < 1:
        print("pdserve profile: error: --threads must be >= 1", file=sys.stderr)
        return 2
    res = profile_engine(args)
    prof = res["profile"]
    out = args.output or Path(f"{prof.name}.json")
    out.write_text(prof.to_json() + "\n")
    print(f"\nwrote {out} (pdserve simulate --profile {out})")
    return 0
