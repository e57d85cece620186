"""Joining a Ray cluster that wants an auth token: find out at the first try, and say which token
is missing and how to pass it.

Given a cluster's address, Ray sends a token only when ``RAY_AUTH_MODE=token`` is set in the
joining process's environment, and takes it from ``RAY_AUTH_TOKEN``, else the file named by
``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. A token-protected cluster refuses anything
else, and Ray's own join retries that refusal for about 20 s before it gives up with "Failed to
connect to Ray cluster". ``check_cluster_token`` asks the cluster's GCS once, with what Ray would
send, and turns a refusal into one line naming the address, the token and where it goes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import grpc

# The GCS call every joining process makes first; with token auth on, it is refused without the
# cluster's token.
PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
PROBE_TIMEOUT_S = 3.0


class RayTokenError(ConnectionError):
    """The cluster refused to talk without its auth token (or with the one sent)."""


def token_source(env: Mapping[str, str], home: Path) -> tuple[str, str] | None:
    """(where the token comes from, the token) as Ray would look for it; None: nowhere."""
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN", env["RAY_AUTH_TOKEN"].strip()
    files = [("~/.ray/auth_token", home / ".ray" / "auth_token")]
    named = env.get("RAY_AUTH_TOKEN_PATH", "")
    if named:
        files.insert(0, (f"RAY_AUTH_TOKEN_PATH ({named})", Path(named)))
    for where, file in files:
        try:
            token = file.read_text().strip()
        except OSError:
            continue
        if token:
            return where, token
    return None


def refusal(address: str, env: Mapping[str, str], source: tuple[str, str] | None) -> str:
    """The line that says why ``address`` refused us and what to do."""
    start = f"the Ray cluster at {address} requires token authentication"
    if source is None:
        return (
            f"{start}, and no token was given: pass the cluster's token (run `ray get-auth-token` on its "
            "head node) as RAY_AUTH_TOKEN=<token>, or in a file named by RAY_AUTH_TOKEN_PATH, with "
            "RAY_AUTH_MODE=token, in this command's environment"
        )
    if env.get("RAY_AUTH_MODE", "").lower() != "token":
        return (
            f"{start}: a token is set ({source[0]}) but RAY_AUTH_MODE is not 'token', so Ray does not "
            "send it: set RAY_AUTH_MODE=token too"
        )
    return (
        f"{start} and refused the token from {source[0]}: it is not the token the cluster was "
        "started with (run `ray get-auth-token` on its head node)"
    )


def _probe_target(address: str) -> str | None:
    """The GCS's ``host:port`` for an address Ray dials directly (not ``auto``, ``ray://``...)."""
    return address if re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s/:\[\]]+):\d{1,5}", address) else None


def check_cluster_token(address: str, env: Mapping[str, str] | None = None, home: Path | None = None) -> None:
    """Raise ``RayTokenError`` when the cluster at ``address`` refuses what Ray would send it;
    anything else (no answer, another error) is left to Ray's own join to report."""
    env = os.environ if env is None else env
    target = _probe_target(address)
    if target is None:
        return
    source = token_source(env, Path.home() if home is None else home)
    sends = source is not None and env.get("RAY_AUTH_MODE", "").lower() == "token"
    metadata = (("authorization", f"Bearer {source[1]}"),) if sends and source is not None else ()
    with grpc.insecure_channel(target) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(PROBE)
        try:
            call(b"", timeout=PROBE_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise RayTokenError(refusal(address, env, source)) from None
