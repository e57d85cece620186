"""Transport peers that run in child processes, so tests can SIGKILL them mid-transfer."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection as Pipe

import torch

from tests.kvtransfer.helpers import transport


def receiver_process(pipe: Pipe, backend: str) -> None:
    torch.set_num_threads(1)
    t = transport(backend)
    pipe.send((t.listen(), t.offers))
    while True:
        cmd = pipe.recv()
        if cmd[0] == "expect":
            t.expect(cmd[1], cmd[2], lease_s=60)
            pipe.send("ok")
        else:
            t.close()
            return


def sender_process(
    pipe: Pipe, backend: str, address: str, tid: str, src: list[int], dst: list[int], layers: int
) -> None:
    """Send ``layers`` layers of a layer-wise transfer, report, then hang until killed."""
    torch.set_num_threads(1)
    t = transport(backend, seed=7)
    t.send(tid, address, src, dst, layerwise=True, timeout_s=60)
    t.layer_ready(tid, layers - 1)
    while t.stats.bytes_sent == 0 and t._senders[backend]._transfers[tid].layers_sent < layers:
        time.sleep(0.01)
    pipe.send("sent")
    time.sleep(3600)
