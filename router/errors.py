"""Errors the router answers with, and their HTTP and gRPC spellings (pure Python)."""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Status codes, named as gRPC names them; ``http`` is the OpenAI-API equivalent."""

    INVALID_ARGUMENT = 400
    UNAUTHENTICATED = 401
    NOT_FOUND = 404
    RESOURCE_EXHAUSTED = 429
    CANCELLED = 499
    INTERNAL = 500
    UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504

    @property
    def http(self) -> int:
        return self.value


class RouterError(Exception):
    """A request-level failure; ``field`` names the offending request field when there is one;
    ``retry_after_s`` tells a refused client when to come back (HTTP Retry-After, gRPC
    ``retry-after-ms`` trailing metadata)."""

    def __init__(
        self, code: Code, message: str, field: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message
