"""Shared pieces of the service tests: bringing a deployment up, HF references, polling."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import psutil

from pdserve.deploy.pools import PoolSpec
from pdserve.deploy.service import Endpoints, Service, ServiceThread
from pdserve.kvtransfer.config import TransportConfig
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.router.config import Caps, RouterConfig
from pdserve.router.slo import SloClass
from pdserve.router.tls import TlsConfig
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from pdserve.worker.control import CheckIntegrity, RequestState

MODEL = "tiny"


def engine_config(**over: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model=MODEL,
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
    )
    base.update(over)
    return EngineConfig(**base)


def start_service(
    use_ray: bool,
    prefill: int = 1,
    decode: int = 1,
    colocated: int = 0,
    api_key: str | None = None,
    caps: Caps | None = None,
    transport: str = "auto",
    local_prefill: bool = False,
    slo_classes: tuple[SloClass, ...] = (),
    migration_limit: int = 3,
    replace_lost: bool = False,
    tls: TlsConfig | None = None,
    internal_tls: bool = False,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    routers: int = 1,
    **engine: Any,
) -> tuple[ServiceThread, Endpoints]:
    """A running service. ``local_prefill`` defaults off so that every request takes the
    disaggregated path (KV transfer) that most tests check; the product default is on. So is
    ``replace_lost`` (off here, so that a test's killed worker leaves the pool it describes)."""
    spec = PoolSpec(
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        engine=engine_config(**engine),
        transport=TransportConfig(backend=transport),
        replace_lost=replace_lost,
        internal_tls=internal_tls,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )
    config = RouterConfig(
        http_port=0, grpc_port=0, api_key=api_key, caps=caps or Caps(max_tokens=2048),
        model_name=engine.get("model", MODEL), tls=tls,
        local_prefill=local_prefill, slo_classes=slo_classes, migration_limit=migration_limit,
        routers=routers,
    )  # fmt: skip
    if use_ray:
        from pdserve.deploy.ray_instance import start_ray

        start_ray(None, 16)  # logical CPUs: room for several small deployments at once
    st = ServiceThread(Service(spec, config, use_ray=use_ray))
    return st, st.start()


@contextlib.contextmanager
def running_service(
    http_client: httpx.Client | None = None, **kwargs: Any
) -> Iterator[tuple[ServiceThread, Endpoints]]:
    """``start_service(**kwargs)`` for a block (a module's fixture): at its end every block is
    free and no per-request state is left anywhere, then the service stops. ``http_client``
    reads the status at the end (one that trusts the service's TLS certificate)."""
    st, ep = start_service(**kwargs)
    try:
        yield st, ep
        wait_for(lambda: all_free(status(ep, client=http_client)), 5, "blocks freed at the end")
        assert_no_request_state(st)
    finally:
        st.stop()


def stub(ep: Endpoints) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(grpc.insecure_channel(ep.grpc))


def status(
    ep: Endpoints, headers: dict[str, str] | None = None, client: httpx.Client | None = None
) -> dict[str, Any]:
    r = (client or httpx).get(f"{ep.http}/cluster/status", headers=headers, timeout=10)
    r.raise_for_status()
    result: dict[str, Any] = r.json()
    return result


def all_free(st: dict[str, Any]) -> bool:
    return all(
        w["running"] == 0 and w["waiting"] == 0 and w["kv_blocks"]["free"] == w["kv_blocks"]["total"]
        for w in st["workers"]
        if w["health"] == "healthy"
    )


def wait_for(
    cond: Callable[[], bool], timeout_s: float, what: str, state: Callable[[], Any] | None = None
) -> float:
    """Poll ``cond`` until true; returns the seconds it took. Fails the test on timeout,
    showing ``state()`` when given."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            shown = f"; state: {state()}" if state else ""
            raise AssertionError(f"not within {timeout_s}s: {what}{shown}")
        time.sleep(0.02)
    return time.monotonic() - t0


def grpc_request(prompt: list[int] | str, max_tokens: int, stream: bool = False, **sampling: Any) -> Any:
    req = pb.GenerateRequest(stream=stream, return_prompt_token_ids=True)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = sampling.pop("temperature", 0.0)
    req.sampling.ignore_eos = sampling.pop("ignore_eos", True)
    for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req


_HF: dict[str, Any] = {}


def hf_reference(prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from HF transformers on the same checkpoint (EOS ignored)."""
    from pdserve.model_runtime.presets import resolve_model
    from tests.engine.hf_models import hf_greedy

    if "model" not in _HF:
        import transformers

        path = str(resolve_model(MODEL).path)
        _HF["model"] = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return hf_greedy(_HF["model"], prompt, n)[0]


async def _router_state(router: Any) -> dict[str, int]:
    state: dict[str, int] = router.request_state()  # on the router's loop: its maps are that loop's
    return state


def assert_no_request_state(st: ServiceThread, timeout_s: float = 5.0) -> None:
    """Once traffic is over: no block in use and every per-request map empty, on every live
    worker (engine, KV manager, transport) and in the router."""
    router = st.service.router
    assert router is not None

    def leftovers() -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for h in st.service.handles:
            if h.alive:
                state = st.run(h.control(RequestState(), timeout_s=10))
                left = {k: v for k, v in state.items() if v}
                if left:
                    out[h.worker_id] = left
        routed = {k: v for k, v in st.run(_router_state(router)).items() if v}
        if routed:
            out["router"] = routed
        return out

    wait_for(lambda: not leftovers(), timeout_s, "no per-request state left", leftovers)
    for h in st.service.handles:
        if h.alive:
            st.run(h.control(CheckIntegrity(), timeout_s=10))


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    """SIGTERM (``pdserve serve`` drains on it), then SIGKILL if it is still there after ``timeout_s``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def token_holders(token: str) -> Iterator[tuple[psutil.Process, dict[str, str]]]:
    """Every process of a test's own Ray cluster (they all carry its auth token), and nothing
    else, with its environment."""
    for p in psutil.process_iter(["name"]):
        try:
            env = p.environ()
        except psutil.Error:  # gone, or not ours to read
            continue
        if env.get("RAY_AUTH_TOKEN") == token:
            yield p, env


def kill_token_holders(token: str) -> None:
    """Stop a test's own Ray cluster (never ``ray stop``, which stops every Ray on the machine)."""
    victims = []
    for p, _ in token_holders(token):
        with contextlib.suppress(psutil.Error):
            p.kill()
            victims.append(p)
    psutil.wait_procs(victims, timeout=15)
