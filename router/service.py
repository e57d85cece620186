"""The router's core, shared by the gRPC and HTTP front ends.

``Router.admit`` checks a request and ``Router.run`` turns it into a stream of events (what
is sent when: the request's state machine, ``pdserve.router.lifecycle``, driven by
``pdserve.router.request_flow``; workers coming and going: ``pdserve.router.membership``)::

    tokenize + validate (caps) -> SLO class -> dispatcher decides (decode worker, prefill worker
                   or local prefill, or REJECTED -> RESOURCE_EXHAUSTED with a retry hint)
    remote prefill: Prefill and QueueReservation(blocks) at once -> AwaitReservation ->
                   SetTarget(KV target) -> first token from prefill -> Start(first token) on
                   decode -> decode's tokens (all worker outputs arrive over
                   ``pdserve.router.outputs``)
    local prefill (colocated, or conditional disaggregation): AddLocal -> decode's tokens
    client gone / deadline / stop string -> abort on every worker that holds the request
    end -> judged against its SLO class (metrics, /dashboard), dispatcher told

Contract: when ``run``'s iterator ends, however it ends, no worker still works on the
request (aborts are sent; workers free the blocks). A worker that dies fails exactly the
requests it held, with UNAVAILABLE; later requests go to the survivors.

Request ids: the router mints its own id for every request; that id, never the client's, is
what workers, the dispatcher and the output channel see. A client's ``request_id`` is only
echoed back (and names the request for ``abort``), so no choice of a client's reaches another
request's state on a worker.

Commands (``pdserve.worker.commands``) go over each worker's own channel and run there in the
order they were sent, so an ``Abort`` never overtakes the command that added its request, and
workers keep no record of ids they never saw.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.generation_config import NO_DEFAULTS, GenerationDefaults
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.model_runtime.validation import RequestLimits, validate_request
from pdserve.router.accounting import Accounting
from pdserve.router.config import RouterConfig
from pdserve.router.constraint_check import ConstraintChecker
from pdserve.router.errors import Code, RouterError
from pdserve.router.membership import Membership
from pdserve.router.outputs import OutputListener
from pdserve.router.policy import Decision, Outcome, RouteRequest
from pdserve.router.pools import Pools
from pdserve.router.prefix import block_keys
from pdserve.router.request_flow import RequestFlow
from pdserve.router.slo import SloClass, SloHint
from pdserve.router.stream import Event, RequestStream
from pdserve.router.workers import WorkerHandle
from pdserve.worker.control import GetLoad
from pdserve.worker.messages import WorkerHealth, WorkerLoad, WorkerRole, WorkItem

log = logging.getLogger(__name__)
__all__ = ["Admitted", "GenerateInput", "ModelInfo", "Router", "SloHint"]

MAX_CLIENT_ID_CHARS = 256  # a client's request id is echoed back and kept while in flight


@dataclass(frozen=True)
class GenerateInput:
    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    slo: SloHint = field(default_factory=SloHint)


def model_id_of(checkpoint_path: str) -> str:
    """The id ``/v1/models`` lists by default: the directory's or GGUF file's name."""
    name = checkpoint_path.rstrip("/").rsplit("/", 1)[-1]
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    max_context_length: int
    vocab_size: int
    block_size: int
    dtype: str
    max_prompt_tokens: int
    max_tokens_cap: int
    max_logprobs: int


@dataclass(frozen=True)
class Admitted:
    stream: RequestStream
    work: WorkItem
    decision: Decision
    slo: SloClass

    @property
    def request_id(self) -> str:
        return self.stream.request_id


class Router:
    def __init__(
        self,
        config: RouterConfig,
        workers: Sequence[WorkerHandle],
        tokenizer: TextTokenizer | None,
        outputs: OutputListener,
        colocated: bool = False,
        generation: GenerationDefaults = NO_DEFAULTS,
        attached: bool = False,
        constraints: ConstraintChecker | None = None,
    ) -> None:
        """``attached``: a router replica (``pdserve.router.replica``): the pool owner started
        ``workers``, more join when their channels open, and their processes are not its to
        control. ``constraints``: compiles each request's constraint before it is routed (none:
        only the structural checks run here, and the workers refuse what does not compile)."""
        if not workers:
            raise ValueError("a router needs workers")
        self.config = config
        self.colocated = colocated
        self.outputs = outputs
        self.workers = {w.worker_id: w for w in workers}
        self.tokenizer = tokenizer
        self.constraints = constraints
        self.generation = generation  # the model's sampling defaults for fields a request leaves unset
        self._streams: dict[str, RequestStream] = {}  # by the router's own request id
        self._client_ids: dict[str, str] = {}  # the client's request id -> the router's
        self.draining = False
        self.pools = Pools(self.workers, colocated)
        info = workers[0].info
        caps = config.caps
        decode_blocks = min(w.info.kv_blocks for w in workers if w.role is not WorkerRole.PREFILL)
        self.limits = RequestLimits(
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            kv_capacity_blocks=decode_blocks,
            max_logprobs=min(caps.max_logprobs, info.max_logprobs),
            has_tokenizer=tokenizer is not None,
            max_prompt_tokens=caps.max_prompt_tokens,
            max_tokens_cap=caps.max_tokens,
        )
        local = min((w.info.step_tokens for w in workers if w.role is not WorkerRole.PREFILL), default=0)
        remote = min((w.info.step_tokens for w in workers if w.role is WorkerRole.PREFILL), default=0)
        self.accounting = Accounting(config, info.block_size, self._loads, local, remote)
        self.metrics = self.accounting.metrics
        self.dispatcher = self.accounting.dispatcher
        self.slos = self.accounting.slos
        self.slo_tracker = self.accounting.tracker
        self.flow = RequestFlow(
            config, self.workers, self.accounting, self._streams,
            lambda stream, why, planned: self.membership.relocate(stream, why, planned),
        )  # fmt: skip
        self._tasks = self.flow.tasks
        self.plans = self.accounting.metrics.plans  # the pool planner's decisions (``/dashboard``)
        name = config.model_name or model_id_of(info.model_dir)
        self.model = ModelInfo(
            model_id=name,
            architecture=info.architecture,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            dtype=info.dtype,
            max_prompt_tokens=caps.max_prompt_tokens or info.max_model_len - 1,
            max_tokens_cap=caps.max_tokens,
            max_logprobs=self.limits.max_logprobs,
        )
        self.membership = Membership(
            config, self.pools, outputs, self.limits, self.model, self.accounting, self.flow,
            self._streams, self._client_ids, self.decide,
        )  # fmt: skip
        self.attached = attached
        self.membership.releases = not attached

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        m = self.membership
        self.outputs.on_kv = self.flow.on_kv_events
        if self.attached:
            self.outputs.bind(
                self.workers, self.flow.on_deltas, m.on_lost, m.on_pool_change, m.attach, m.switched
            )
        else:
            self.outputs.bind(self.workers, self.flow.on_deltas, m.on_lost, m.on_pool_change)

    async def stop(self) -> None:
        for s in list(self._streams.values()):
            s.fail(RouterError(Code.UNAVAILABLE, "the server is shutting down"))
        if self.constraints is not None:
            await self.constraints.close()
        await self.outputs.close()

    def _loads(self) -> list[WorkerLoad]:
        unhealthy = WorkerHealth.UNHEALTHY
        return [
            replace(w.load, tp=w.info.tp) if w.alive else replace(w.load, health=unhealthy, tp=w.info.tp)
            for w in self.workers.values()
        ]

    @property
    def ready(self) -> bool:
        if self.draining:
            return False
        # With every prefill worker gone, decode workers prefill requests themselves (slower,
        # but served): the dispatchers fall back to local prefill.
        return bool(self.pools.decoders())

    def request_state(self) -> dict[str, int]:
        """Sizes of the router's per-request maps: all zero once no request is in flight (a
        worker's own maps: ``WorkerHost.request_state``)."""
        return {
            "streams": len(self._streams),
            "client_ids": len(self._client_ids),
            "tasks": len(self._tasks),
            "worker_inflight": sum(len(w.inflight) for w in self.workers.values()),
            "commands_waiting": sum(w.channel.waiting for w in self.workers.values() if w.channel),
        }

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait for in-flight requests to finish. True if they all did."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    # -- requests ----------------------------------------------------------------------------
    def prepare(self, inp: GenerateInput) -> tuple[str, tuple[int, ...]]:
        """Tokenize and validate; returns (the router's request id, prompt ids). Raises
        ``RouterError(INVALID_ARGUMENT)`` naming the field."""
        prompt = inp.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise RouterError(Code.INVALID_ARGUMENT, "prompt: must not be empty", "prompt")
            if self.tokenizer is None:
                raise RouterError(
                    Code.INVALID_ARGUMENT, "prompt: this model has no tokenizer; send token ids", "prompt"
                )
            ids = tuple(self.tokenizer.encode(prompt))
        else:
            ids = tuple(prompt)
        try:
            validate_request(ids, inp.params, self.limits)
        except InvalidRequestError as e:
            raise RouterError(Code.INVALID_ARGUMENT, str(e), e.field) from None
        if len(inp.request_id) > MAX_CLIENT_ID_CHARS:
            raise RouterError(
                Code.INVALID_ARGUMENT, f"request_id: at most {MAX_CLIENT_ID_CHARS} characters", "request_id"
            )
        if inp.request_id in self._client_ids:
            raise RouterError(
                Code.INVALID_ARGUMENT, f"request_id: {inp.request_id!r} is already in flight", "request_id"
            )
        return f"req-{uuid.uuid4().hex}", ids

    async def check_constraint(self, params: SamplingParams) -> None:
        """Refuse (``RouterError(INVALID_ARGUMENT)`` naming the field) a constraint that does not
        compile, compiles too slowly or too large, or matches nothing, before anything is
        routed (``router/constraint_check.py``). The structural checks ran when the API made
        the constraint (``structured_api.checked``), and run again in ``admit``'s validation."""
        c = params.constraint
        if c is None:
            return
        try:
            if self.tokenizer is None:
                raise InvalidRequestError("response_format", "this model has no tokenizer to constrain with")
            if self.constraints is not None:
                await self.constraints.check(c)
        except InvalidRequestError as e:
            raise RouterError(Code.INVALID_ARGUMENT, str(e), e.field) from None

    def admit(self, inp: GenerateInput) -> Admitted:
        """Check a request, route it and take it in (raises ``RouterError`` before anything is
        sent: INVALID_ARGUMENT, UNAVAILABLE, or RESOURCE_EXHAUSTED with ``retry_after_s``)."""
        rid, ids = self.prepare(inp)
        self.accounting.window.arrived(time.monotonic(), len(ids), inp.params.max_tokens)
        if self.draining:
            raise RouterError(Code.UNAVAILABLE, "the server is draining")
        if len(self._streams) >= self.config.max_inflight:
            raise RouterError(
                Code.RESOURCE_EXHAUSTED, "too many requests in flight; retry later", retry_after_s=1.0
            )
        try:
            slo = self.slos.resolve(inp.slo.slo_class, inp.slo.ttft_ms, inp.slo.tpot_ms)
        except ValueError as e:
            raise RouterError(Code.INVALID_ARGUMENT, f"slo_class: {e}", "slo_class") from None
        keys = block_keys(ids, self.limits.block_size) if self.config.policy == "goodput" else ()
        route = RouteRequest(len(ids), inp.params.max_tokens, inp.slo.priority, rid, keys, slo)
        decision = self.decide(route)
        self.accounting.decided(rid, decision)
        if decision.outcome is Outcome.REJECTED:
            self.accounting.judge(slo, None)
            raise RouterError(
                Code.RESOURCE_EXHAUSTED,
                f"no worker is predicted to meet SLO class {slo.name!r} ({decision.reason}: predicted TTFT"
                f" {decision.predicted_ttft_s * 1e3:.0f} ms, TPOT {decision.predicted_tpot_s * 1e3:.1f} ms);"
                " retry later",
                retry_after_s=decision.retry_after_s,
            )
        stream = RequestStream(rid, ids, inp.params, self.tokenizer, inp.request_id or rid)
        stream.slo = slo
        self._streams[rid] = stream
        self._client_ids[stream.client_id] = rid
        return Admitted(stream, WorkItem(rid, ids, inp.params, decision.priority), decision, slo)

    def decide(self, route: RouteRequest, remote_prefill: bool = True, avoid: str = "") -> Decision:
        """Where the request goes; ``remote_prefill=False``: only to a decode worker, which
        prefills it itself; ``avoid``: a prefill worker not to send it to."""
        decode = [w.load for w in self.pools.decoders()]
        if not decode:
            raise RouterError(Code.UNAVAILABLE, f"no healthy {self.pools.decode_role.value} worker")
        remote = remote_prefill and not self.colocated
        pool = self.pools.routable(WorkerRole.PREFILL) if remote else []
        prefill = [w.load for w in pool if w.worker_id != avoid]
        return self.dispatcher.decide(route, prefill, decode, time.perf_counter())

    def discard(self, admitted: Admitted) -> None:
        """Forget an admitted request that will not be run (nothing was sent for it)."""
        self._forget(admitted.stream)
        self.accounting.dropped(admitted.request_id)

    def _forget(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        if self._client_ids.get(stream.client_id) == stream.request_id:
            del self._client_ids[stream.client_id]

    async def run(self, admitted: Admitted) -> AsyncIterator[Event]:
        """Events of an admitted request; see the module docstring for the contract."""
        stream = admitted.stream
        self.flow.start(stream, admitted.work, admitted.decision)
        try:
            async for ev in stream.events():
                yield ev
        finally:
            self._forget(stream)
            if not stream.done:
                stream.abort()
            self.flow.release(stream)
            self.accounting.ended(admitted.slo, stream)

    def generate(self, inp: GenerateInput) -> AsyncIterator[Event]:
        return self.run(self.admit(inp))

    async def abort(self, request_id: str) -> bool:
        """Abort the request the client named ``request_id``; False if none is in flight."""
        stream = self._streams.get(self._client_ids.get(request_id, ""))
        if stream is None:
            return False
        stream.abort()
        return True

    # -- status ------------------------------------------------------------------------------
    async def cluster_status(self) -> tuple[bool, str, list[WorkerLoad]]:
        """Fresh loads from every worker (a short call each); unreachable ones as UNHEALTHY."""

        async def one(w: WorkerHandle) -> WorkerLoad:
            if w.alive:
                try:
                    w.load = await w.control(GetLoad(), timeout_s=2.0)
                    return replace(w.load, tp=w.info.tp)
                except Exception as e:
                    log.warning("status of %s: %s", w.worker_id, e)
            return replace(w.load, health=WorkerHealth.UNHEALTHY, tp=w.info.tp)

        loads = await asyncio.gather(*(one(w) for w in self.workers.values()))
        mode = "colocated" if self.colocated else "disaggregated"
        return self.ready, mode, sorted(loads, key=lambda x: x.worker_id)
