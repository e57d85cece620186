"""A rank of a tensor-parallel worker killed mid-stream fails its whole worker at once: its
streams move and finish token-exact elsewhere, no collective hangs, its other ranks stop, and
nothing is left held anywhere."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from pdserve.v1 import inference_pb2 as pb
from tests.service.helpers import (
    assert_no_request_state,
    grpc_request,
    hf_reference,
    start_service,
    status,
    stub,
    wait_for,
)
from tests.service.test_migration import assert_moved_token_exact, finish, prompts, start_streams

pytest.importorskip("transformers")


def _rank_pids(st: Any, worker_id: str) -> list[int]:
    """The child ranks of an in-process worker."""
    host = next(h for h in st.service.handles if h.worker_id == worker_id).caller.host
    setup = host.rt.ranks
    assert setup is not None and setup.ranks is not None
    return list(setup.ranks.pids)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of this process has exited too.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def test_a_decode_rank_killed_mid_stream_moves_its_streams_token_exact() -> None:
    st, ep = start_service(
        use_ray=False, prefill=1, decode=2, decode_tp=2, tp_timeout_s=10.0, replace_lost=True
    )
    try:
        degrees = {w["worker_id"]: w["tp"] for w in status(ep)["workers"]}
        assert degrees == {"prefill-0": 1, "decode-0": 2, "decode-1": 2}  # the degree is part of a worker
        s = stub(ep)
        ps = prompts(4, seed=61)
        calls = start_streams(s, ps)
        pids = _rank_pids(st, "decode-0")
        os.kill(pids[0], signal.SIGKILL)
        handle = next(h for h in st.service.handles if h.worker_id == "decode-0")
        wait_for(lambda: not handle.alive, 10.0, "decode-0 seen lost")
        assert_moved_token_exact(ps, finish(calls), "decode-1")

        def replaced() -> bool:  # a fresh worker of the lost one's degree
            fresh = [w for w in status(ep)["workers"] if w["worker_id"] not in degrees]
            return any(w["tp"] == 2 and w["health"] == "healthy" for w in fresh)

        wait_for(replaced, 60.0, "decode-0 replaced at degree 2")
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_prefill_rank_killed_moves_its_prompts_and_stops_its_other_ranks() -> None:
    st, ep = start_service(use_ray=False, prefill=2, decode=1, prefill_tp=2, tp_timeout_s=10.0)
    try:
        s = stub(ep)
        pids = _rank_pids(st, "prefill-0")
        os.kill(pids[0], signal.SIGKILL)
        ps = prompts(6, seed=62)
        calls = [(s.Generate(grpc_request(p, 8, stream=True)), []) for p in ps]  # some reach prefill-0
        for p, (tokens, result) in zip(ps, finish(calls), strict=True):
            assert result is not None and result.finish_reason == pb.FINISH_REASON_LENGTH
            assert tokens == hf_reference(p, 8)
        handle = next(h for h in st.service.handles if h.worker_id == "prefill-0")
        wait_for(lambda: not handle.alive, 10.0, "prefill-0 seen lost")
        wait_for(lambda: all(_gone(pid) for pid in pids), 10.0, "prefill-0's ranks stopped")
        assert_no_request_state(st)
    finally:
        st.stop()
