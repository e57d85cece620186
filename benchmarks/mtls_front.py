"""What serving mutual TLS through ``TlsFront`` costs, against gRPC's own (C core) TLS.

Under ``--tls-client-ca`` both front ends do their handshakes in Python (so that a refused
client gets the TLS alert and the server logs why) and relay each accepted connection to the
server behind them over a unix socket. This measures that path on a trivial gRPC service (a
60-byte message per unary call or stream item, so that the transport dominates): a server
process per round, alternating "core" (grpc.ssl_server_credentials with
require_client_auth) and "front" (TlsFront + gRPC on a unix socket), the client in this process.

    .venv/bin/python -m benchmarks.mtls_front               # about a minute
    .venv/bin/python -m benchmarks.mtls_front --rounds 5

Final JSON line: per path, the medians over rounds of the server's CPU per message (its whole
process: gRPC, the relay and TLS), one unary call's latency, and messages per second at 1 and
32 concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from benchmarks.client import free_port
from benchmarks.common import emit
from pdserve.router.tls import TlsConfig, mutual_context
from pdserve.router.tls_front import TlsFront

MESSAGE = b"x" * 60
UNARY_CALLS = 500
STREAMS = ((1, 20_000), (32, 2_000))  # (concurrent streams, items each)


async def _serve(mode: str, port: int, pki: Path) -> None:
    async def items(request: bytes, context: Any) -> Any:
        for _ in range(int(request)):
            yield MESSAGE

    async def unary(request: bytes, context: Any) -> bytes:
        return MESSAGE

    server = grpc.aio.server()
    methods: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        "S": grpc.unary_stream_rpc_method_handler(items),
        "U": grpc.unary_unary_rpc_method_handler(unary),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.B", methods)])
    config = TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))
    front = None
    if mode == "core":
        pair = (Path(config.key_file).read_bytes(), Path(config.cert_file).read_bytes())
        ca = Path(config.client_ca_file).read_bytes()
        creds = grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=True)
        server.add_secure_port(f"127.0.0.1:{port}", creds)
    else:
        backend = os.path.join(tempfile.mkdtemp(), "grpc")
        server.add_insecure_port(f"unix:{backend}")
        listener = socket.create_server(("127.0.0.1", port))
        front = TlsFront("gRPC", mutual_context(config, "h2"), listener, backend)
    await server.start()
    if front is not None:
        await front.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _client(port: int, pki: Path) -> dict[str, float]:
    creds = grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        items: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream("/bench.B/S")
        unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/bench.B/U")
        await unary(b"")
        t0 = time.perf_counter()
        for _ in range(UNARY_CALLS):
            await unary(b"")
        out = {"unary_us": (time.perf_counter() - t0) / UNARY_CALLS * 1e6}

        async def one(n: int) -> int:
            return sum([1 async for _ in items(str(n).encode())])

        for streams, n in STREAMS:
            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(n) for _ in range(streams)))
            out[f"msgs_per_s_{streams}x"] = sum(got) / (time.perf_counter() - t0)
    return out


def _round(mode: str, pki: Path) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.mtls_front", "--serve", mode, "--port", str(port),
           "--pki", str(pki)]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        proc = psutil.Process(server.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        out = asyncio.run(_client(port, pki))
        messages = 1 + UNARY_CALLS + sum(s * n for s, n in STREAMS)
        out["server_cpu_us_per_msg"] = (sum(proc.cpu_times()[:2]) - cpu0) / messages * 1e6
        return out
    finally:
        server.kill()
        server.wait()


def _pki(root: Path) -> Path:
    import trustme

    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("client@example.test")
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(root / "server.pem"))
    server.private_key_pem.write_to_path(str(root / "server.key"))
    client.cert_chain_pems[0].write_to_path(str(root / "client.pem"))
    client.private_key_pem.write_to_path(str(root / "client.key"))
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each path, alternating")
    p.add_argument("--serve", choices=["core", "front"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pki", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.port, args.pki))
        return
    with tempfile.TemporaryDirectory() as tmp:
        pki = _pki(Path(tmp))
        rounds: dict[str, list[dict[str, float]]] = {"core": [], "front": []}
        for _ in range(args.rounds):
            for mode, seen in rounds.items():
                seen.append(_round(mode, pki))
                print(mode, {k: round(v, 1) for k, v in seen[-1].items()}, flush=True)
    emit(
        {
            mode: {k: round(statistics.median(r[k] for r in seen), 1) for k in seen[0]}
            for mode, seen in rounds.items()
        }
    )


if __name__ == "__main__":
    main()
