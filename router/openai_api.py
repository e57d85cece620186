"""OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, cluster status.

Requests are checked and admitted before any byte of the response is sent, and a stream's
first event is awaited before the response starts, so every failure that happens before the
first token gets a real status code (400, 401, 429, 503); later failures end the SSE stream
with an ``error`` event. A client that disconnects aborts its request on every worker.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.model_runtime.sampling_params import SEED_MAX, SamplingParams
from pdserve.router.auth import ApiKeyMiddleware
from pdserve.router.chat import ChatTemplate
from pdserve.router.dashboard import PAGE_PATH, install_dashboard
from pdserve.router.errors import Code, RouterError
from pdserve.router.openai_format import ChoiceBuilder, error_body, invalid_request, sse_data, usage_json
from pdserve.router.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.router.openapi_doc import install_openapi
from pdserve.router.service import Admitted, GenerateInput, Router
from pdserve.router.status import cluster_status_json
from pdserve.router.stream import Event, Final
from pdserve.router.structured_api import ToolCallFormat, constraint_from_openai
from pdserve.router.tool_prompt import chat_messages

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STARTED = time.time()


def build_http_app(router: Router, chat_template: ChatTemplate, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="pdserve", version="1", description="OpenAI-compatible API of a pdserve cluster")
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=("/health", PAGE_PATH))

    @app.exception_handler(RouterError)
    async def router_error(_: Request, e: RouterError) -> JSONResponse:
        headers = None
        if e.retry_after_s is not None:  # whole seconds, rounded up (RFC 9110)
            headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}
        return JSONResponse(error_body(e), status_code=e.code.http, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # The framework's own refusals (a body that is not JSON, an unknown path or method)
        # in the same error shape as every other answer of this API.
        kind = {404: "not_found_error"}.get(e.status_code, "invalid_request_error")
        body = {"error": {"message": str(e.detail), "type": kind, "param": None, "code": e.status_code}}
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        return JSONResponse(error_body(invalid_request(err, e.body)), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        ok = router.ready
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        m = router.model
        return {
            "object": "list",
            "data": [
                {
                    "id": m.model_id,
                    "object": "model",
                    "created": int(STARTED),
                    "owned_by": "pdserve",
                    "max_model_len": m.max_context_length,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster/status")
    async def cluster_status() -> dict[str, Any]:
        return cluster_status_json(*await router.cluster_status())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(router, body.model)
        params = body.sampling_params(router.config.caps, body.max_tokens, body.logprobs, router.generation)
        params = replace(params, constraint=constraint_from_openai(body).constraint)
        prompts = body.prompts()
        inputs = [
            GenerateInput(p, params_for(params, i, body.n), slo=body.slo_hint())
            for p in prompts
            for i in range(body.n)
        ]
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await respond(router, request, body, inputs, rid, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(router, body.model)
        params = body.sampling_params(
            router.config.caps, body.requested_max_tokens(), body.requested_logprobs(), router.generation
        )
        structured = constraint_from_openai(body, chat_template.uses_tools)
        params = replace(params, constraint=structured.constraint)
        fmt = structured.tool_format
        messages, tools = chat_messages(body.messages, structured.tools, fmt, chat_template.uses_tools)
        prompt = chat_template.prompt_ids(messages, tools)
        inputs = [
            GenerateInput(prompt, params_for(params, i, body.n), slo=body.slo_hint()) for i in range(body.n)
        ]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await respond(router, request, body, inputs, rid, chat=True, tool_format=fmt)

    install_dashboard(app, router)
    classes = tuple(router.slos.classes)
    install_openapi(app, router.model.model_id, router.config.caps, router.model.vocab_size, classes)
    return app


def _check_model(router: Router, model: str) -> None:
    if model != router.model.model_id:
        raise RouterError(
            Code.INVALID_ARGUMENT,
            f"model: {model!r} is not served here; this server serves {router.model.model_id!r}",
            "model",
        )


def params_for(params: SamplingParams, index: int, n: int) -> SamplingParams:
    """The i-th of ``n`` sequences: a seeded request gets seed + i, so the n samples differ
    (modulo 2**64, as the sampler reads a seed: the last seed wraps round to 0)."""
    if n > 1 and params.seed is not None:
        seed = params.seed + index
        return replace(params, seed=seed - 2**64 if seed > SEED_MAX else seed)
    return params


async def respond(
    router: Router,
    request: Request,
    body: SamplingFields,
    inputs: Sequence[GenerateInput],
    rid: str,
    chat: bool,
    tool_format: ToolCallFormat | None = None,
) -> Response:
    admitted: list[Admitted] = []
    if inputs:  # the inputs share one constraint (``n`` and prompt lists): compiled once
        await router.check_constraint(inputs[0].params)
    try:
        for i, inp in enumerate(inputs):
            admitted.append(router.admit(replace(inp, request_id=f"{rid}-{i}")))
    except RouterError:
        for a in admitted:
            router.discard(a)
        raise
    builder = ChoiceBuilder(
        router.tokenizer, rid, chat, body.return_token_ids, body.model, len(admitted), tool_format
    )
    events = merged(router, admitted)
    if not body.stream:
        return await _until_disconnected(request, collect(builder, events), named(router))
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(
        sse(builder, first, events, body.include_usage),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **named(router)},
    )


def named(router: Router) -> dict[str, str]:
    """The header naming the router replica that served a response ("": one router, none)."""
    rid = router.config.router_id
    return {"x-pdserve-router": rid} if rid else {}


async def merged(router: Router, admitted: Sequence[Admitted]) -> AsyncGenerator[tuple[int, Event], None]:
    """Events of several sequences (``n`` > 1, batched prompts) as (choice index, event)."""
    if len(admitted) == 1:
        async for ev in router.run(admitted[0]):
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, a: Admitted) -> None:
        try:
            async for ev in router.run(a):
                queue.put_nowait((i, ev))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, a)) for i, a in enumerate(admitted)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(builder: ChoiceBuilder, events: AsyncIterator[tuple[int, Event]]) -> dict[str, Any]:
    async for i, ev in events:
        builder.add(i, ev)
    return builder.response()


async def sse(
    builder: ChoiceBuilder,
    first: tuple[int, Event] | None,
    events: AsyncGenerator[tuple[int, Event], None],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    finals: list[Final] = []
    try:
        if builder.chat:
            for i in range(builder.num_choices):
                yield sse_data(builder.role_chunk(i))
        pending = [first] if first is not None else []
        while True:
            if pending:
                i, ev = pending.pop()
            else:
                try:
                    i, ev = await anext(events)
                except StopAsyncIteration:
                    break
            if isinstance(ev, Final):
                finals.append(ev)
            if event := builder.stream_event(i, ev):
                yield event
        if include_usage:
            yield sse_data(builder.usage_chunk(usage_json(finals)))
    except RouterError as e:
        yield sse_data(error_body(e))
    finally:
        await events.aclose()
    yield b"data: [DONE]\n\n"


async def _until_disconnected(request: Request, work: Any, headers: dict[str, str]) -> Response:
    """Run a non-streaming request, aborting it if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        body = await task
    except asyncio.CancelledError:
        return Response(status_code=499)
    finally:
        watcher.cancel()
    return JSONResponse(body, headers=headers or None)
