"""API-key checks for both front ends (constant-time comparison, ``Authorization: Bearer``)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def bearer_ok(header: str | bytes | None, api_key: str) -> bool:
    if header is None:
        return False
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyMiddleware:
    """Plain ASGI (no per-request task, streaming untouched): 401 unless the key matches, on every
    path except ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if bearer_ok(headers.get(b"authorization"), self.api_key):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "missing or invalid API key (Authorization: Bearer <key>)",
                    "type": "authentication_error",
                    "param": None,
                    "code": 401,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})
