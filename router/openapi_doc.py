"""``/openapi.json`` as the HTTP API really answers (FastAPI's generated document, corrected).

FastAPI documents what it would do by default; pdserve answers differently in a few ways, and
a client generator or a fuzzer takes the document at its word:

- a request that fails validation gets **400** with an OpenAI-style error body, never 422;
  so does a schema-valid request that breaks a limit the schema cannot state (prompt plus
  ``max_tokens`` beyond the context, a range ``SamplingParams`` checks);
- the generation routes may also answer 401 (with an API key configured), 429 (admission:
  no worker predicted to meet the SLO, too many in flight; with ``Retry-After``) and 503 (no
  healthy worker, draining); a streamed response is ``text/event-stream``;
- ``model`` must be the served model's id (an enum of one), the per-request caps of this server
  (``max_tokens``, ``n``, ``logprobs``) are the schema's maxima, the sampling ranges are those
  ``SamplingParams`` checks (``RANGES``), ``slo_class`` names a configured class, and token ids
  lie in the model's vocabulary;
- ``/metrics`` is Prometheus text, ``/health`` answers 503 while not ready.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pdserve.model_runtime.sampling_params import RANGES, SEED_RANGE, Range
from pdserve.router.config import Caps

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
GENERATION_ERRORS = {
    "400": "invalid request: a field fails validation, or the request breaks a limit the schema "
    "cannot state (prompt + max_tokens beyond the context, a sampling range)",
    "401": "an API key is configured and the request did not carry it",
    "429": "not admitted now (no worker predicted to meet its SLO, or too many in flight); see Retry-After",
    "503": "no healthy worker, or the server is draining",
}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
REQUEST_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest")


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


def install_openapi(
    app: FastAPI, model_id: str, caps: Caps, vocab_size: int, slo_classes: tuple[str, ...] = ()
) -> None:
    """Serve the corrected document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)  # fmt: skip
            app.openapi_schema = correct(doc, model_id, caps, vocab_size, slo_classes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def correct(
    doc: dict[str, Any], model_id: str, caps: Caps, vocab_size: int, slo_classes: tuple[str, ...] = ()
) -> dict[str, Any]:
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            responses: dict[str, Any] = op.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = _error(GENERATION_ERRORS["400"])
            if path in GENERATION_PATHS:
                for code, text in GENERATION_ERRORS.items():
                    responses.setdefault(code, _error(text))
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).setdefault("application/json", {"schema": {}})
                ok["content"]["text/event-stream"] = {"schema": {}}  # events: the chunks, then [DONE]
            elif path == "/metrics":
                responses["200"] = {
                    "description": "Prometheus text exposition",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            elif path == "/health":
                responses["503"] = {"description": "not ready (no healthy worker, or draining)",
                                    "content": {"application/json": {"schema": {}}}}  # fmt: skip
            if path != "/health":
                responses.setdefault("401", _error(GENERATION_ERRORS["401"]))
    schemas = doc.get("components", {}).get("schemas", {})
    for name in REQUEST_SCHEMAS:
        props = schemas.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [model_id], "title": "Model"}
        limits = {
            **RANGES,  # the sampling ranges, and this server's caps:
            "seed": SEED_RANGE,
            "max_tokens": Range(1, caps.max_tokens),
            "max_completion_tokens": Range(1, caps.max_tokens),
            "n": Range(1, caps.max_n),
            "logprobs": Range(0, caps.max_logprobs),
            "top_logprobs": Range(0, caps.max_logprobs),
        }
        for field, allowed in limits.items():
            if field in props:
                _bound(props[field], allowed)
        if "slo_class" in props and slo_classes:
            props["slo_class"]["enum"] = ["", *slo_classes]
    _bound_token_ids(doc, vocab_size)
    return doc


def _bound(prop: dict[str, Any], allowed: Range) -> None:
    """Give a numeric property (or the numeric branch of a nullable one) its range."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") not in ("number", "integer"):
            continue
        if allowed.low is not None:
            branch["exclusiveMinimum" if allowed.low_open else "minimum"] = allowed.low
        if allowed.high is not None:
            branch["maximum"] = allowed.high


def _bound_token_ids(node: Any, vocab_size: int, is_ids: bool = False) -> None:
    """Every integer array item under a prompt or stop_token_ids is a token id of the model."""
    if isinstance(node, dict):
        if is_ids and node.get("type") == "array" and node.get("items", {}).get("type") == "integer":
            node["items"].update(minimum=0, maximum=vocab_size - 1)
        for key, value in node.items():
            _bound_token_ids(value, vocab_size, is_ids or key in ("prompt", "stop_token_ids"))
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size, is_ids)
