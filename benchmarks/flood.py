"""A hostile neighbour of a listener that authenticates its peers (a KV receiver, the router's
worker channel): hold N idle TCP connections to each address that never send a byte, reopen
each one the moment the listener closes it, for SECONDS or until SIGTERM. Loopback addresses only (a test's
own listeners). It prints ``ready`` once it has opened N connections to each address, and a
final JSON line counting the connections opened and closed by the listener.

    .venv/bin/python -m benchmarks.flood 127.0.0.1:PORT[,127.0.0.1:PORT...] --connections 300 --seconds 10
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import selectors
import signal
import socket
import subprocess
import sys
import time


def loopback(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"{address}: a flood goes to loopback addresses only")
    return host, int(port)


BURST = 32  # connections to one address not yet taken in by its listener (no byte from it yet)


def flood(addresses: list[str], connections: int, seconds: float) -> dict[str, int]:
    """Keep ``connections`` idle connections open to each address for ``seconds``. Connects are
    non-blocking, and at most ``BURST`` per address wait to be taken in (their first byte from
    the listener), so the flood keeps pace with the listener's accepting instead of overflowing
    its accept queue (where the kernel would let later connections, a real peer's, pass it)."""
    targets = [loopback(a) for a in addresses]
    sel = selectors.DefaultSelector()
    held = dict.fromkeys(targets, 0)  # open, taken in or not
    waiting = dict.fromkeys(targets, 0)  # open and not taken in yet
    opened = closed = failed = 0
    ready = False
    end = time.monotonic() + seconds
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while time.monotonic() < end and not stop:
        if not ready and opened >= connections * len(targets):
            print("ready", flush=True)
            ready = True
        for target in targets:
            while held[target] < connections and waiting[target] < BURST:
                new = socket.socket()
                new.setblocking(False)
                new.connect_ex(target)
                sel.register(new, selectors.EVENT_WRITE, (target, "connecting"))
                held[target] += 1
                waiting[target] += 1
        for key, _ in sel.select(timeout=0.01):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            target, state = key.data
            if state == "connecting":  # the connect finished, one way or the other
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    sel.modify(sock, selectors.EVENT_READ, (target, "connected"))
                    opened += 1
                    continue
                failed += 1
            else:
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:  # a challenge: never answered; the listener has taken it in
                    if state == "connected":
                        waiting[target] -= 1
                        sel.modify(sock, selectors.EVENT_READ, (target, "taken"))
                    continue
                closed += 1
            if state != "taken":
                waiting[target] -= 1
            sel.unregister(sock)
            sock.close()
            held[target] -= 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return {"opened": opened, "closed_by_listener": closed, "connect_failures": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("addresses", help="host:port[,host:port...], loopback only")
    ap.add_argument("--connections", type=int, default=300, help="idle connections held per address")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    # (json, not benchmarks.common.emit: a flood starts in milliseconds, without torch)
    print(json.dumps(flood([a for a in args.addresses.split(",") if a], args.connections, args.seconds)))


def start(addresses: list[str], connections: int, seconds: float) -> subprocess.Popen[str]:
    """The flood in a process of its own, as a neighbour's would be; its JSON line on stdout."""
    cmd = [sys.executable, "-m", "benchmarks.flood", ",".join(addresses), "--connections", str(connections),
           "--seconds", str(seconds)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen[str]) -> None:
    """Until the flood has opened its connections (raises if it ended first)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"the flood ended before it was under way: {line!r}")


def result(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict[str, int]:
    """Stop the flood (SIGTERM) and read its counts."""
    proc.terminate()
    out, _ = proc.communicate(timeout=timeout_s)
    counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return counts


if __name__ == "__main__":
    main()
