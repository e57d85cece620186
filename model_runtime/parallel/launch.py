"""How each rank of a tensor-parallel worker comes up: rank 0 checks the degree, serves the
rendezvous, starts the other ranks and joins the group with them; every rank then loads its
shard of the weights and the ranks agree on one KV pool size (each holds the same block ids).

A degree the model cannot shard fails here, before any process starts, with the valid degrees
named (``sharding.check_degree``).
"""

from __future__ import annotations

import multiprocessing.connection as mpc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.parallel.group import TPGroup, serve_store
from pdserve.model_runtime.parallel.ranks import RankArgs, Ranks
from pdserve.model_runtime.parallel.sharding import RankShard, ShardingError, check_degree, shape_of, shard

JOIN_TIMEOUT_S = 600.0  # loading a large shard takes minutes; the ranks wait for each other
RankEntry = Callable[[RankArgs, mpc.Connection], None]


@dataclass
class RankSetup:
    """One rank's place in its worker: its shard, its group and (rank 0) the other ranks."""

    shard: RankShard
    group: TPGroup
    ranks: Ranks | None = None

    @property
    def rank(self) -> int:
        return self.shard.rank

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()
        self.group.close()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` of a worker on GPUs runs on the worker's ``r``-th visible GPU."""
    if device.type != "cuda":
        return device
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    return dev


def check_tp(model_config: Any, tp: int) -> None:
    try:
        check_degree(shape_of(model_config), tp)
    except ShardingError as e:
        raise ModelLoadError(str(e)) from None


def start_leader(
    config: Any, model_config: Any, device: torch.device, entry: RankEntry, extra: Any = None
) -> RankSetup:
    """Rank 0: start ranks 1..tp-1 (``entry(args, pipe)`` in a child process each) and join
    the group with them."""
    tp = int(config.tp)
    check_tp(model_config, tp)
    store = serve_store("127.0.0.1", JOIN_TIMEOUT_S)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    args = [RankArgs(r, tp, ("127.0.0.1", store.port), config, extra, threads) for r in range(1, tp)]
    ranks = Ranks(entry, args, answer_timeout_s=float(config.tp_timeout_s))
    try:
        group = _join(0, tp, store, device, float(config.tp_timeout_s))
    except BaseException:
        ranks.stop()
        raise
    return RankSetup(shard(shape_of(model_config), tp, 0), group, ranks)


def join_follower(args: RankArgs, model_config: Any, device: torch.device) -> RankSetup:
    """Rank ``args.rank`` > 0: join rank 0's group."""
    timeout = float(args.config.tp_timeout_s)
    group = _join(args.rank, args.size, args.store, device, timeout)
    return RankSetup(shard(shape_of(model_config), args.size, args.rank), group)


def _join(rank: int, size: int, store: Any, device: torch.device, timeout_s: float) -> TPGroup:
    return TPGroup(rank, size, store, device, timeout_s, JOIN_TIMEOUT_S)


def agree_on_blocks(setup: RankSetup, num_blocks: int) -> int:
    """The pool size every rank can hold: the smallest rank's (GPUs' free memory differs)."""
    return min(setup.group.agree("num_blocks", num_blocks))
