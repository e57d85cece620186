"""The gRPC front end: ``pdserve.v1.Inference`` plus standard health and reflection (v1 and
v1alpha, ``pdserve.router.reflection``).

Status codes follow ``proto/pdserve/v1/inference.proto``. A cancelled call or an expired
deadline cancels the handler, whose cleanup aborts the request on every worker (the
``Router.run`` contract). With an API key set every call except ``grpc.health.v1`` (probes
cannot send metadata) needs ``authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.model_runtime.generation_config import NO_DEFAULTS, GenerationDefaults
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind
from pdserve.router.auth import bearer_ok
from pdserve.router.config import Caps
from pdserve.router.errors import Code, RouterError
from pdserve.router.reflection import enable_reflection
from pdserve.router.service import GenerateInput, Router, SloHint
from pdserve.router.stream import Chunk, Final
from pdserve.router.structured_api import make_constraint
from pdserve.router.tls import TlsMaterial
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from pdserve.worker.messages import Logprob, WorkerHealth, WorkerRole

log = logging.getLogger(__name__)

# An interceptor passes any method's handler through: the request and response types of one call.
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
STATUS = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.CANCELLED: grpc.StatusCode.CANCELLED,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}
FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "stop_string": pb.FINISH_REASON_STOP_STRING,
    "abort": pb.FINISH_REASON_ABORT,
}
ROLE = {
    WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
    WorkerRole.COLOCATED: pb.WORKER_ROLE_COLOCATED,
}
HEALTH = {
    WorkerHealth.STARTING: pb.WORKER_HEALTH_STARTING,
    WorkerHealth.HEALTHY: pb.WORKER_HEALTH_HEALTHY,
    WorkerHealth.UNHEALTHY: pb.WORKER_HEALTH_UNHEALTHY,
    WorkerHealth.DRAINING: pb.WORKER_HEALTH_DRAINING,
}


MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # proto3 `optional`
OPTIONAL_SAMPLING = ("seed", "logprobs")


def sampling_params(
    s: pb.SamplingParameters, caps: Caps, defaults: GenerationDefaults = NO_DEFAULTS
) -> SamplingParams:
    # Fields the client left unset take the model's defaults, then SamplingParams' own (the one
    # place they live).
    fields = {name: getattr(s, name) if s.HasField(name) else None for name in MODEL_DEFAULTED}
    given = {name: getattr(s, name) for name in OPTIONAL_SAMPLING if s.HasField(name)}
    return SamplingParams.create(
        **caps.with_defaults(defaults, fields, s.max_tokens if s.HasField("max_tokens") else None),
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        **given,
    )


CONSTRAINTS = {  # the GenerateRequest.constraint oneof's fields
    "json_schema": ConstraintKind.JSON_SCHEMA,
    "json_object": ConstraintKind.JSON_OBJECT,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
}


def constraint(request: pb.GenerateRequest) -> Constraint | None:
    """The request's ``constraint`` oneof as the HTTP API's fields become one (``RouterError``
    naming the field when a worker would refuse it)."""
    which = request.WhichOneof("constraint")
    if which is None or (which == "json_object" and not request.json_object):
        return None
    value = request.choice.options if which == "choice" else getattr(request, which)
    return make_constraint(CONSTRAINTS[which], value, which)


def _logprobs(lps: tuple[Logprob, ...] | None) -> list[pb.TokenLogprob]:
    if not lps:
        return []
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps
    ]


def _result(f: Final, with_prompt: bool) -> pb.GenerateResult:
    r = pb.GenerateResult(
        request_id=f.request_id,
        finish_reason=FINISH.get(f.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            cached_tokens=f.usage.cached_tokens,
        ),
        timing=pb.Timing(**dataclasses.asdict(f.timing)),
        prefill_worker=f.prefill_worker,
        decode_worker=f.decode_worker,
        prompt_token_ids=list(f.prompt_token_ids) if with_prompt else [],
        migrations=f.migrations,
    )
    if isinstance(f.stop_reason, str):
        r.stop_string = f.stop_reason
    elif isinstance(f.stop_reason, int):
        r.stop_token_id = f.stop_reason
    return r


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse],
    ) -> AsyncIterator[pb.GenerateResponse]:
        which = request.WhichOneof("prompt")
        prompt: str | list[int] = request.text if which == "text" else list(request.token_ids.ids)
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set text or token_ids")
        try:
            params = sampling_params(request.sampling, self.router.config.caps, self.router.generation)
            params = dataclasses.replace(params, constraint=constraint(request))
            hint = request.slo
            slo = SloHint(hint.ttft_ms, hint.tpot_ms, hint.priority, hint.slo_class)
            await self.router.check_constraint(params)
            admitted = self.router.admit(GenerateInput(prompt, params, request.request_id, slo))
        except RouterError as e:
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
            await context.abort(STATUS[e.code], e.message)
        if self.router.config.router_id:  # which replica serves it (with the first message)
            await context.send_initial_metadata((("pdserve-router", self.router.config.router_id),))
        with_prompt = request.return_prompt_token_ids
        ids: list[int] = []
        text: list[str] = []
        lps: list[pb.TokenLogprob] = []
        try:
            async for ev in self.router.run(admitted):
                if isinstance(ev, Chunk):
                    if request.stream:
                        yield pb.GenerateResponse(
                            chunk=pb.TokenChunk(
                                token_ids=ev.token_ids, text=ev.text, logprobs=_logprobs(ev.logprobs)
                            )
                        )
                    else:
                        ids.extend(ev.token_ids)
                        text.append(ev.text)
                        lps.extend(_logprobs(ev.logprobs))
                else:
                    chunk = pb.TokenChunk(token_ids=ids, text="".join(text), logprobs=lps)
                    yield pb.GenerateResponse(chunk=chunk, result=_result(ev, with_prompt))
        except RouterError as e:
            await context.abort(STATUS[e.code], e.message)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse]
    ) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.router.abort(request.request_id))

    async def GetModelInfo(
        self,
        request: pb.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetModelInfoRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        m = self.router.model
        return pb.ModelInfo(
            model_id=m.model_id,
            architecture=m.architecture,
            max_context_length=m.max_context_length,
            vocab_size=m.vocab_size,
            block_size=m.block_size,
            dtype=m.dtype,
            max_prompt_tokens=m.max_prompt_tokens,
            max_tokens_cap=m.max_tokens_cap,
            max_logprobs=m.max_logprobs,
        )

    async def GetClusterStatus(
        self,
        request: pb.GetClusterStatusRequest,
        context: grpc.aio.ServicerContext[pb.GetClusterStatusRequest, pb.ClusterStatus],
    ) -> pb.ClusterStatus:
        ready, mode, loads = await self.router.cluster_status()
        return pb.ClusterStatus(
            ready=ready,
            mode=mode,
            workers=[
                pb.WorkerStatus(
                    worker_id=w.worker_id,
                    role=ROLE[w.role],
                    address=w.address,
                    running=w.running,
                    waiting=w.waiting,
                    kv_blocks=pb.KvBlocks(total=w.kv_total, free=w.kv_free, cached=w.kv_cached),
                    health=HEALTH[w.health],
                    tp=w.tp,
                )
                for w in loads
            ],
        )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    OPEN_PREFIX = "/grpc.health.v1.Health/"

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer <key>)"
            )

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await deny(request, context)
            yield  # pragma: no cover (abort raises)

        self._deny_unary: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        if details.method.startswith(self.OPEN_PREFIX):
            return await continuation(details)
        md = dict(details.invocation_metadata or ())
        if bearer_ok(md.get("authorization"), self.api_key):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny_unary


class GrpcServer:
    """The grpc.aio server with the inference, health and reflection services: its ``address``
    (``host:port``, or ``unix:path`` behind a ``TlsFront``) bound from construction, the
    services added and served from ``start``."""

    def __init__(
        self,
        address: str,
        max_message_bytes: int,
        api_key: str | None = None,
        tls: TlsMaterial | None = None,
        reuse_port: bool = False,
    ) -> None:
        """``reuse_port``: router replicas share the port (the kernel spreads connections over
        them and stops sending to one whose process ended); off, a taken port is an error."""
        self.router: Router | None = None
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(api_key)] if api_key else None,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", int(reuse_port)),
            ],
        )
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                credentials = grpc.ssl_server_credentials(
                    [(tls.private_key, tls.cert_chain)],
                    root_certificates=tls.client_ca,
                    require_client_auth=tls.config.mutual,
                )
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError:  # grpc's way of saying the bind failed
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {address}: in use, or not an address of this host")
        self.health = health.aio.HealthServicer()
        self._watch: asyncio.Task[None] | None = None

    async def start(self, router: Router) -> None:
        self.router = router
        pb_grpc.add_InferenceServicer_to_server(InferenceService(router), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self.server)
        await self.server.start()
        self._watch = asyncio.create_task(self._watch_readiness(router))

    async def _watch_readiness(self, router: Router) -> None:
        last: bool | None = None
        while True:
            ready = router.ready
            if ready != last:
                hc = health_pb2.HealthCheckResponse
                status = hc.SERVING if ready else hc.NOT_SERVING
                await self.health.set(SERVICE, status)
                await self.health.set("", status)
                last = ready
            await asyncio.sleep(0.2)

    async def stop(self, grace_s: float) -> None:
        """Stop serving, or (never started) let the port go."""
        if self._watch is not None:
            self._watch.cancel()
        if self.router is not None:
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
