"""Sending one request and timing what comes back: OpenAI-compatible HTTP or pdserve gRPC.

Every chunk that carries output is stamped on arrival; ``itls`` are the gaps between such
chunks (one per chunk, as ``vllm bench serve`` counts them). The output length is the server's
own count (``usage`` or token ids) when it gives one.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

import grpc
import httpx

from pdserve.bench.metrics import RequestResult
from pdserve.bench.workload import RequestSpec
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc


class ServerError(Exception):
    """The server could not be asked what it serves: nothing can be measured."""


class Backend(Protocol):
    where: str  # what the models were asked of, for messages
    model: str | None  # sent with each request (OpenAI); the result's model_id

    async def served_models(self) -> list[str]: ...

    async def send(self, spec: RequestSpec) -> RequestResult: ...

    async def close(self) -> None: ...


def http_error(status: int, body: bytes) -> str:
    """``HTTP <status>: <message>``: the OpenAI error body's message where there is one (so
    equal causes read equal in the failure summary), else the start of the body."""
    text = body.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        detail = err.get("message") if isinstance(err, dict) else err or data.get("detail")
        if isinstance(detail, str) and detail:
            text = detail
    return f"HTTP {status}: {' '.join(text.split())[:300]}"


def _stamp(result: RequestResult, t0: float, last: float | None, now: float) -> float:
    if last is None:
        result.ttft = now - t0
    else:
        result.itls.append(now - last)
    return now


class OpenAIBackend:
    def __init__(
        self, base_url: str, endpoint: str, model: str | None, api_key: str | None, temperature: float
    ) -> None:
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits, headers=headers)
        self.endpoint = endpoint
        self.model = model  # None: ask the server (``served_models``) before sending
        self.temperature = temperature
        # The model list sits beside the endpoint (/v1/completions -> /v1/models), as vLLM's is.
        self.models_path = endpoint.rsplit("/", 1)[0] + "/models"
        self.where = f"GET {base_url.rstrip('/')}{self.models_path}"

    async def served_models(self) -> list[str]:
        """The ids ``GET /v1/models`` lists."""
        try:
            resp = await self.client.get(self.models_path, timeout=30)
        except httpx.HTTPError as e:
            raise ServerError(f"{self.where}: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise ServerError(f"{self.where}: {http_error(resp.status_code, resp.content)}")
        try:
            data = resp.json()["data"]
            return [str(m["id"]) for m in data]
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"{self.where}: not an OpenAI model list: {resp.text[:200]!r}") from None

    async def send(self, spec: RequestSpec) -> RequestResult:
        assert self.model is not None, "choose the model (served_models) before sending"
        body = {
            "model": self.model,
            "prompt": list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt,
            "max_tokens": spec.output_len,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = RequestResult(prompt_len=spec.prompt_len)
        t0 = time.perf_counter()
        last: float | None = None
        chunks = 0
        try:
            async with self.client.stream("POST", self.endpoint, json=body) as resp:
                if resp.status_code != 200:
                    r.error = http_error(resp.status_code, await resp.aread())
                    r.rejected = resp.status_code == 429
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        r.error = str(data["error"].get("message", data["error"]))
                        return r
                    if data.get("usage"):
                        r.output_len = int(data["usage"].get("completion_tokens", 0))
                    choices = data.get("choices") or []
                    if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                        last = _stamp(r, t0, last, time.perf_counter())
                        chunks += 1
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            r.error = f"{type(e).__name__}: {e}"
            return r
        r.latency = time.perf_counter() - t0
        r.output_len = r.output_len or chunks
        r.success = last is not None
        if not r.success:
            r.error = "no output"
        return r

    async def close(self) -> None:
        await self.client.aclose()


class PdserveGrpcBackend:
    def __init__(self, address: str, api_key: str | None, temperature: float) -> None:
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.temperature = temperature
        self.model: str | None = None  # the gRPC API names no model: only the result records it
        self.where = f"GetModelInfo at {address}"

    async def served_models(self) -> list[str]:
        """The one model a pdserve deployment serves (the gRPC API names none in requests)."""
        try:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=30)
        except grpc.aio.AioRpcError as e:
            raise ServerError(f"{self.where}: {e.code().name}: {e.details()}") from None
        return [info.model_id]

    async def send(self, spec: RequestSpec) -> RequestResult:
        req = pb.GenerateRequest(stream=True)
        if isinstance(spec.prompt, str):
            req.text = spec.prompt
        else:
            req.token_ids.ids.extend(spec.prompt)
        req.sampling.max_tokens = spec.output_len
        req.sampling.temperature = self.temperature
        req.sampling.ignore_eos = True
        r = RequestResult(prompt_len=spec.prompt_len)
        t0 = time.perf_counter()
        last: float | None = None
        try:
            async for msg in self.stub.Generate(req, metadata=self.metadata):
                if msg.chunk.token_ids:
                    last = _stamp(r, t0, last, time.perf_counter())
                    r.output_len += len(msg.chunk.token_ids)
        except grpc.aio.AioRpcError as e:
            r.error = f"{e.code().name}: {e.details()}"
            r.rejected = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return r
        r.latency = time.perf_counter() - t0
        r.success = last is not None
        if not r.success:
            r.error = "no output"
        return r

    async def close(self) -> None:
        await self.channel.close()
