"""A worker with a channel to its pool owner and to a router replica, both ends written by
hand: the worker says what it is first on each connection, a request's deltas go only to the
router that sent it, every router learns the work the others placed there, and a replica whose
connection ends has its requests aborted at once (blocks freed), then is connected to again,
its first batch a snapshot of the prefix cache."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.kvtransfer.config import TransportConfig
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.worker.command_codec import decode_from_worker, encode_command
from pdserve.worker.commands import AddLocal
from pdserve.worker.messages import OutputBatch, WorkerInfo, WorkerRole, WorkItem
from pdserve.worker.spec import WorkerSpec
from tests.workers.test_command_channel import SECRET, FakeRouter

ENGINE = EngineConfig(
    model="tiny", cache=CacheConfig(block_size=8, num_blocks=256), scheduler=SchedulerConfig(64, 8)
)


class HandRouter(FakeRouter):
    """A router's end of worker channels, by hand: accepts, authenticates, reads frames."""

    def accept_info(self) -> WorkerInfo:
        wid = self.accept()
        assert self.conn is not None
        first = decode_from_worker(self._read(self.conn), wid)
        assert isinstance(first, WorkerInfo), "the first frame says what the worker is"
        return first

    def send(self, call_id: int, cmd: AddLocal) -> None:
        assert self.conn is not None
        self.conn.sendall(encode_command(call_id, cmd))

    def batches(self, seconds: float) -> list[OutputBatch]:
        """Output batches read for ``seconds`` (answers skipped)."""
        assert self.conn is not None
        out: list[OutputBatch] = []
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.conn.settimeout(left)
            try:
                frame = decode_from_worker(self._read(self.conn), "d0")
            except TimeoutError:
                break
            if isinstance(frame, OutputBatch):
                out.append(frame)
        return out

    def hang_up(self) -> None:
        assert self.conn is not None
        self.conn.close()
        self.conn = None


@pytest.fixture
def routers() -> Iterator[tuple[HandRouter, HandRouter, DecodeWorker]]:
    owner, replica = HandRouter(), HandRouter()
    spec = WorkerSpec("d0", WorkerRole.DECODE, ENGINE, TransportConfig(backend="tcp"), SECRET,
                      router_address=owner.address, replica_addresses=(replica.address,))  # fmt: skip
    worker = DecodeWorker(spec)
    try:
        assert owner.accept_info().worker_id == "d0"
        assert replica.accept_info().role is WorkerRole.DECODE
        yield owner, replica, worker
        assert worker.wait_idle(5.0)
        worker.check_integrity()
        assert not any(worker.request_state().values())
    finally:
        worker.shutdown()
        owner.close()
        replica.close()


def work(rid: str, n: int) -> WorkItem:
    return WorkItem(rid, tuple(range(5, 25)), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def test_deltas_go_to_their_router_and_the_others_learn_the_work(routers) -> None:
    owner, replica, worker = routers
    replica.send(1, AddLocal(work("r-replica", 1800)))
    seen = replica.batches(0.5)
    mine = [d for b in seen for d in b.deltas]
    assert mine and {d.request_id for d in mine} == {"r-replica"}
    assert all(b.load.others.decodes == 0 for b in seen)  # the replica's own request is no "other"
    at_owner = owner.batches(0.3)
    assert at_owner and not any(b.deltas for b in at_owner)  # none of its deltas went to the owner
    assert any(b.load.others.decodes == 1 and b.load.others.decode_remaining > 0 for b in at_owner)
    owner.send(1, AddLocal(work("r-owner", 4)))
    got = [d for b in owner.batches(1.0) for d in b.deltas]
    assert {d.request_id for d in got} == {"r-owner"} and got[-1].finished
    assert worker.request_state()["owned_by_router_1"] == 1  # still running
    replica.hang_up()  # its process died: its request is aborted here, its blocks freed
    t0 = time.monotonic()
    while worker.request_state().get("owned_by_router_1", 1) or worker.load().running:
        assert time.monotonic() - t0 < 1.0, worker.request_state()
        time.sleep(0.01)
    assert worker.pusher is not None and worker.pusher.aborted_for_lost_routers == 1
    assert replica.accept_info().worker_id == "d0"  # and it connects again, for the replica's restart
    replica.send(1, AddLocal(work("r-again", 3)))
    batches = replica.batches(1.0)
    # a reconnected router first learns the whole prefix cache: the earlier prompts' blocks
    assert batches[0].kv is not None and batches[0].kv.snapshot, batches[0].kv
    again = [d for b in batches for d in b.deltas]
    assert {d.request_id for d in again} == {"r-again"} and again[-1].finished
