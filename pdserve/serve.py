"""``pdserve serve``: bring up worker pools and the router, serve until a signal, drain."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import re
import sys
import time
from pathlib import Path

from pdserve.deploy.pools import PoolSpec
from pdserve.deploy.service import Service
from pdserve.flags import (
    add_layout,
    add_policy,
    colocated_count,
    finite_at_least,
    int_at_least,
    port,
)
from pdserve.kvtransfer.config import BACKENDS, NODE_ADDRESS, TransportConfig
from pdserve.model_runtime.backend import OVERLAP_SETTINGS, step_sizes
from pdserve.model_runtime.config import COMPUTE_MODES, CacheConfig, EngineConfig
from pdserve.model_runtime.presets import MODEL_NAMES
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule, QueuePolicy, SchedulerConfig
from pdserve.planning.autoscale import PoolAutoscaler
from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import PlannerConfig
from pdserve.planning.settings import add_autoscale, planner_settings
from pdserve.router.config import MIN_LIVENESS_S, Caps, RouterConfig
from pdserve.router.server import StopSignals, chat_summary, first_of, serve_until_signal
from pdserve.router.slo import Admission, SloBook, SloClass
from pdserve.router.tls import TlsConfig, load_tls, tls_from_flags
from pdserve.steptime.load import load_profile
from pdserve.steptime.parallel import at_degree


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_layout(p)
    p.add_argument("--transport", choices=BACKENDS, default="auto", help="KV transfer backend")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a private one)")
    p.add_argument("--local", action="store_true", help="run workers as threads of this process (no Ray)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of both APIs (default: loopback)")
    p.add_argument("--grpc-port", type=port, default=50051)
    p.add_argument("--http-port", type=port, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="or PDSERVE_API_KEY")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC and HTTP over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", default=None, help="PEM CA: require client certificates it signed (mutual TLS)"
    )
    p.add_argument(
        "--internal-tls",
        action="store_true",
        help="run the KV and worker channels over TLS (a private CA per deployment; for links between nodes)",
    )
    add_policy(p, "goodput")
    add_autoscale(p)
    p.add_argument(
        "--autoscale-start-wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --autoscale: how long a change waits for its new workers to be placed and ready "
        "before it gives up on them and lets the next decision retry (default: twice the interval, "
        "at least 30 s)",
    )
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="NAME:ttft=MS,tpot=MS[,admission=reject|best-effort|none]",
        help="an SLO class (repeatable; the first is the default unless --default-slo-class)",
    )
    p.add_argument("--default-slo-class", default="", help="class of requests that name none")
    p.add_argument(
        "--latency-profile",
        default="",
        help="goodput policy's prior: built-in name or `pdserve profile` JSON (default: the emulated "
        "profile, else h100-llama3-8b; corrected online from observed latencies either way)",
    )
    p.add_argument(
        "--no-local-prefill",
        dest="local_prefill",
        action="store_false",
        help="goodput policy: never prefill on a decode worker (no conditional disaggregation)",
    )
    p.add_argument("--served-model-name", default="", help="model id in the API (default: directory name)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="cap (0: the context length)")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens accepted")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=Caps.default_max_tokens,
        help="max_tokens of a request that names none and whose model's generation_config has no "
        f"max_new_tokens (default {Caps.default_max_tokens}, the OpenAI completions default)",
    )
    p.add_argument("--max-n", type=int, default=8, help="largest n accepted")
    p.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs accepted")
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=0,
        help="KV cache per worker (default: 256 on a CPU; on a GPU what the weights leave free, less "
        "a reserve for activations and CUDA graphs)",
    )
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--gpus-per-worker", type=int, default=-1, help="default: 1 with CUDA, else 0")
    p.add_argument(
        "--compute",
        default="model",
        help=f"{' | '.join(COMPUTE_MODES)}: the model, no math, or a GPU's timing (emulated:h100-llama3-8b)",
    )
    p.add_argument(
        "--overlap",
        choices=OVERLAP_SETTINGS,
        default="auto",
        help="plan and launch each decode step while the one before runs, stops seen a step late "
        "(default auto: on a GPU)",
    )
    p.add_argument(
        "--step-log",
        default="",
        metavar="DIR",
        help="each worker appends a JSON line per forward step (start, end, chunks) to DIR/<worker>.jsonl: "
        "what calibrates `pdserve simulate` against this service (off by default)",
    )
    p.add_argument(
        "--drain-timeout", type=finite_at_least(0.0), default=30.0, help="grace for in-flight requests"
    )
    p.add_argument(
        "--worker-drain-timeout", type=finite_at_least(0.0), default=30.0, metavar="S",
        help="a worker sent SIGTERM takes no new requests and lets its own finish for up to S seconds; "
        "the rest move to other workers",
    )  # fmt: skip
    p.add_argument(
        "--no-replace-lost-workers", dest="replace_lost", action="store_false",
        help="do not start a fresh worker in place of one that was lost (pools shrink instead)",
    )  # fmt: skip
    p.add_argument(
        "--migration-limit", type=int_at_least(0), default=3, metavar="N",
        help="a stream whose decode worker is lost moves to another one at most N times (0: it fails)",
    )  # fmt: skip
    p.add_argument(
        "--no-prefill-rebalance", dest="rebalance_prefill", action="store_false",
        help="a prompt stays on the prefill worker it was sent to, even when the pool grows or a "
        "worker leaves it before the prompt started",
    )  # fmt: skip
    p.add_argument(
        "--liveness-timeout", type=finite_at_least(MIN_LIVENESS_S), default=4.0, metavar="S",
        help="a worker that sends nothing (not even its heartbeat) for S seconds is lost: its streams move",
    )  # fmt: skip
    p.add_argument(
        "--routers", type=int, default=1, metavar="N",
        help="router replicas in front of the one pool (default 1: this process routes); N > 1: "
        "this process owns the pool and N replica processes share the HTTP and gRPC ports, so a "
        "router that dies costs only its own streams",
    )  # fmt: skip
    p.add_argument(
        "--kv-host",
        default="",
        help="cluster-internal bind address of KV transfer and the worker channels (default: "
        "loopback on a private instance; with --address, each node's own address)",
    )


def build(args: argparse.Namespace) -> tuple[PoolSpec, RouterConfig]:
    gpus = args.gpus_per_worker
    if gpus < 0:
        import torch

        gpus = 1 if args.device != "cpu" and torch.cuda.is_available() else 0
    # an emulated GPU's steps take a GPU's time, so it batches as a GPU does (the simulator's
    # defaults): a CPU's budget would cap its decode batch far below what its KV pool holds
    on_gpu = gpus > 0 or bool(_emulated(args.compute))
    tokens, seqs = step_sizes(on_gpu, args.max_num_batched_tokens, args.max_num_seqs)
    engine = EngineConfig(
        model=args.model,
        device="cuda" if gpus else args.device,
        dtype=args.dtype,
        cache=CacheConfig(block_size=args.block_size, memory_budget_bytes=args.kv_cache_mib << 20),
        scheduler=SchedulerConfig(  # priority order: best-effort admissions run last
            max_num_batched_tokens=tokens,
            max_num_seqs=seqs,
            policy=QueuePolicy.PRIORITY,
            colocated=ColocatedSchedule(args.colocated_schedule),
        ),
        max_logprobs=args.max_logprobs,
        compute=args.compute,
        step_log=str(Path(args.step_log).resolve()) if args.step_log else "",
        overlap=args.overlap,
        tp=args.decode_tp,  # each pool's workers at its own degree (``PoolSpec.tp_of``)
    )
    colocated = colocated_count(args)
    # The goodput policy's prior, at each pool's degree (its workers' GPUs).
    prior = load_profile(args.latency_profile or _emulated(args.compute) or "h100-llama3-8b")
    kv_host = args.kv_host or (NODE_ADDRESS if args.address else "127.0.0.1")
    tls = tls_from_flags(args.tls_cert, args.tls_key, args.tls_client_ca)
    if tls is not None:
        load_tls(tls)  # a wrong file fails here, with the flag's name
    spec = PoolSpec(
        prefill=args.prefill,
        decode=args.decode,
        colocated=colocated,
        engine=engine,
        transport=TransportConfig(backend=args.transport, host=kv_host),
        cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=gpus,
        replace_lost=args.replace_lost,
        drain_timeout_s=args.worker_drain_timeout,
        internal_tls=args.internal_tls,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
    )
    config = RouterConfig(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        api_key=args.api_key or None,
        tls=tls,
        caps=Caps(
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens_cap,
            default_max_tokens=args.default_max_tokens,
            max_n=args.max_n,
            max_logprobs=args.max_logprobs,
        ),
        policy=args.policy,
        latency_profile=at_degree(prior, args.decode_tp),
        prefill_latency_profile=at_degree(prior, args.prefill_tp)
        if args.prefill_tp != args.decode_tp
        else None,
        local_prefill=args.local_prefill,
        slo_classes=tuple(SloClass.parse(c) for c in args.slo),
        default_slo_class=args.default_slo_class,
        model_name=args.served_model_name or (args.model if args.model in MODEL_NAMES else ""),
        drain_timeout_s=args.drain_timeout,
        migration_limit=args.migration_limit,
        rebalance_prefill=args.rebalance_prefill,
        liveness_timeout_s=args.liveness_timeout,
        worker_channel_host=kv_host,
        routers=args.routers,
    )
    return spec, config


def planner_config(args: argparse.Namespace, spec: PoolSpec, config: RouterConfig) -> PlannerConfig | None:
    """``--autoscale``'s planner settings: the bounds, the default SLO class's targets and the
    workers' decode batch cap."""
    if not args.autoscale:
        return None
    if colocated_count(args):
        raise ValueError("--autoscale resizes prefill and decode pools: not with --colocated")
    if not args.autoscale_interval > 0:  # NaN too: checked here, before any worker starts
        raise ValueError(f"--autoscale-interval must be > 0 seconds, not {args.autoscale_interval}")
    wait = args.autoscale_start_wait
    if wait is not None and not 0 < wait < math.inf:
        raise ValueError(f"--autoscale-start-wait must be > 0 seconds, not {wait}")
    slos = SloBook.of(*config.slo_classes, default=config.default_slo_class or None)
    target = slos.resolve()
    if not (target.ttft_ms and target.tpot_ms):
        raise ValueError(
            "--autoscale sizes the pools for an SLO: give the default class both targets "
            "(--slo NAME:ttft=MS,tpot=MS)"
        )
    refuses = target.admission is Admission.REJECT
    seqs = spec.engine.scheduler.max_num_seqs
    return planner_settings(args, target.ttft_ms / 1000, target.tpot_ms / 1000, refuses, seqs)


def _emulated(compute: str) -> str:
    return compute.partition(":")[2] if compute.startswith("emulated:") else ""


def failure_reason(e: BaseException) -> str:
    """The one line that says why: a worker's own error (Ray wraps it, traceback and all, in its
    actor error; its last line is the worker's exception), or the error itself."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    own = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return own[-1] if own else (lines[-1] if lines else type(e).__name__)


async def _run(
    service: Service,
    started: float,
    plan: PlannerConfig | None = None,
    interval_s: float = 30.0,
    start_wait_s: float | None = None,
) -> bool:
    spec = service.spec
    shape = (
        f"{spec.colocated} colocated"
        if spec.is_colocated
        else f"{spec.prefill} prefill + {spec.decode} decode, KV over {spec.transport.backend}"
    )
    where = "in-process" if not service.use_ray else f"Ray {service.ray_address or '(local)'}"
    print(f"pdserve: starting {shape} workers on {where} with model {spec.engine.model!r}...", flush=True)
    signals = StopSignals()
    service.on_ray_lost = signals.stop_now
    try:
        clean = await _serve(service, started, plan, (interval_s, start_wait_s), signals)
    finally:
        signals.close()
    if service.ray_lost:
        # Everything this process started is stopped; what is left are threads waiting on the
        # GCS that is gone (a worker's start, Ray's own exit hook), which would hold the exit
        # for a minute, then abort it.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
    return clean


async def _serve(
    service: Service,
    started: float,
    plan: PlannerConfig | None,
    timing: tuple[float, float | None],
    signals: StopSignals,
) -> bool:
    interval_s, start_wait_s = timing
    try:
        up, ep = await first_of(service.start(progress=True), signals.drain)
    except Exception as e:  # a worker that did not start, a port taken, no room on the cluster
        # One write, on a line of its own: Ray's thread forwarding the workers' logs to this
        # stderr may be halfway through a line (a dead actor's traceback) when this is printed.
        sys.stderr.write(f"\npdserve: error: the deployment did not start: {failure_reason(e)}\n")
        sys.stderr.flush()
        await service.stop()
        return False
    if not up or ep is None:  # a signal during start-up: stop what has started
        print("pdserve: stopping before the deployment was ready", flush=True)
        await service.stop()
        print("pdserve: stopped", flush=True)
        return False
    assert service.router is not None and service.frontends is not None
    print(
        f"pdserve: ready in {time.monotonic() - started:.1f}s\n"
        f"  OpenAI HTTP  {ep.http}/v1   (model {service.router.model.model_id!r})\n"
        f"  gRPC         {ep.grpc}   (pdserve.v1.Inference, health, reflection)\n"
        f"  chat         {chat_summary(service.router, service.frontends.chat_template)}\n"
        f"  routers      {_routers_summary(service)}\n"
        f"  auth         {'API key required' if service.config.api_key else 'off'}\n"
        f"  tls          {tls_summary(service.config.tls)}\n"
        f"  internal     {'TLS (deployment CA)' if service.spec.internal_tls else 'plaintext'} KV and worker "
        f"channels, authenticated with the deployment secret; workers connect to {service.channel_address}\n"
        "  Ctrl-C drains and stops.",
        flush=True,
    )
    scaler = None
    if plan is not None:
        profile = service.config.latency_profile
        assert profile is not None
        scaler = PoolAutoscaler(
            service, Planner(profile, plan), interval_s, warmup_s=interval_s, grow_wait_s=start_wait_s
        )
        scaler.start()
        b = plan.bounds
        print(
            f"  autoscale    every {interval_s:g} s: prefill {b.min_prefill}-{b.max_prefill}, "
            f"decode {b.min_decode}-{b.max_decode}, for TTFT {plan.ttft_s * 1e3:g} ms "
            f"/ TPOT {plan.tpot_s * 1e3:g} ms",
            flush=True,
        )
    drained = False
    try:
        if service.replicas is not None:
            clean = await _serve_replicas(service, signals)
        else:
            clean = await serve_until_signal(
                service.router, service.frontends, service.config.drain_timeout_s, signals
            )
            drained = True
    finally:
        if scaler is not None:
            await scaler.stop()
        if drained:  # the drain stopped them; otherwise the service's stop does
            service.frontends = None
            service.router = None
        await service.stop()
    print("pdserve: stopped" + ("" if clean else " (some requests were aborted)"), flush=True)
    return clean


async def _serve_replicas(service: Service, signals: StopSignals) -> bool:
    """The pool owner of router replicas: serve until a signal, then drain the replicas (each
    its own streams; a second signal stops them at once)."""
    await signals.drain.wait()
    timeout = service.config.drain_timeout_s
    print(f"draining {service.config.routers} router replicas (up to {timeout:g}s)...", flush=True)
    finished, clean = await first_of(service.stop_replicas(timeout), signals.now)
    return bool(finished and clean)


def _routers_summary(service: Service) -> str:
    if service.replicas is None:
        return "1 (this process)"
    pids = ", ".join(str(p) for p in service.replicas.pids())
    return f"{service.config.routers} replicas sharing both ports (pids {pids}); this process owns the pool"


def tls_summary(tls: TlsConfig | None) -> str:
    if tls is None:
        return "off (plaintext; --tls-cert/--tls-key to turn it on)"
    if tls.mutual:
        return f"on, mutual: clients need a certificate signed by {tls.client_ca_file}"
    return f"on ({tls.cert_file})"


def serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        spec, config = build(args)
        plan = planner_config(args, spec, config)
        if plan is not None:  # the private Ray instance must have room for the largest layout
            spec = dataclasses.replace(spec, max_workers=plan.bounds.max_prefill + plan.bounds.max_decode)
    except ValueError as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    if config.host == "0.0.0.0" and not config.api_key:
        print("pdserve: warning: serving on all interfaces without an API key", file=sys.stderr)
    service = Service(spec, config, use_ray=not args.local, ray_address=args.address)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    clean = asyncio.run(_run(service, started, plan, args.autoscale_interval, args.autoscale_start_wait))
    return 0 if clean else 1
