"""The router learns where prefixes are cached from the workers' own events (their output
batches), not from its guesses: after traffic, its index of every worker is that worker's pool's
cached keys, the decode worker's included (it caches the prompt blocks it received), and a
prompt sharing a prefix is routed to the prefill worker that holds it."""

from __future__ import annotations

from typing import Any

from pdserve.router.goodput import GoodputPolicy
from pdserve.router.prefix import block_keys

from .helpers import grpc_request, running_service, stub, wait_for


def cached_keys(handle: Any) -> set[bytes]:
    host = handle.caller.host  # an in-process worker
    return set(host.loop.call(lambda: host.engine.kv.pool.cached_keys()))


async def _view(pol: GoodputPolicy, worker_id: str) -> frozenset[bytes]:
    return pol.prefix.holds(worker_id)  # read on the router's loop, which changes it


def test_the_routers_index_is_what_every_worker_caches() -> None:
    with running_service(use_ray=False, prefill=2, decode=1) as (st, ep):
        router = st.service.router
        assert router is not None and isinstance(router.dispatcher, GoodputPolicy)
        pol = router.dispatcher
        pol.prefix.hint_s = 0.0  # the workers' events alone
        client = stub(ep)
        shared = [(7 * i) % 250 + 1 for i in range(96)]  # 6 blocks of 16
        first = list(client.Generate(grpc_request([*shared, 3, 4, 5], 2), timeout=60))[-1].result

        def views_match() -> bool:
            return all(
                st.run(_view(pol, h.worker_id)) == cached_keys(h) for h in st.service.handles if h.alive
            )

        wait_for(views_match, 5, "the router's index matches every worker's pool")
        holder = first.prefill_worker
        assert block_keys(shared, 16)[-1] in st.run(_view(pol, holder))
        assert block_keys(shared, 16)[-1] in st.run(_view(pol, first.decode_worker))  # received KV
        again = list(client.Generate(grpc_request([*shared, 9, 9, 9, 9], 2), timeout=60))[-1].result
        assert again.prefill_worker == holder and again.usage.cached_tokens == 96
        wait_for(views_match, 5, "the router's index matches every worker's pool")
