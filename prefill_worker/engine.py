"""The prefill role: chunked prefill with prefix caching; the first token is sampled here and
the prompt's KV is pushed into blocks a decode worker reserved.

Per request::

    add(work, target?) -> WAITING --scheduled--> PREFILLING --last chunk--> PREFILLED
        PREFILLED: first token reported (TokenDelta.prefilled); source blocks held while the KV
        streams out (or until ``set_target`` names where it goes, then it streams)
        --transport: finished_sending | failed--> source blocks freed (they stay prefix-cached);
          a failed push is reported as ``TokenDelta.kv_lost`` (not an error: the first token is
          out, and the decode worker recomputes the prompt)
    the first token already ends the request (EOS, max_tokens=1): reported finished, the
    transfer is cancelled; abort: removed wherever it is, its transfer cancelled.
    withdraw (WAITING only): removed as if it had never come (the router routes it again).

Ids: the router's commands arrive in the order it sent them (one channel per worker), so an
abort never overtakes the add it cancels; an unknown id is simply not here (handed off or
finished) and leaves no trace.

The router may send the request before the decode worker has reserved blocks (both at once,
so the reservation is off the TTFT path); the target follows with ``set_target``. A push that
can start with the step computing the prompt's last chunk is layer-wise: layer ``i`` goes out
while layer ``i + 1`` computes (earlier chunks are complete by then); a target that arrives
later gets the whole KV in one push.
Single-threaded like every engine: one caller serializes ``add``/``abort``/``step``.
"""

from __future__ import annotations

import logging

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.model_runtime.scheduler.prefill import PrefillScheduler
from pdserve.model_runtime.validation import validate_request
from pdserve.worker.deltas import delta_for, error_delta
from pdserve.worker.engine_base import RoleEngineBase
from pdserve.worker.grammar_gate import GrammarGate
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerRole, WorkItem
from pdserve.worker.ports import RoleRuntime, Transport

log = logging.getLogger(__name__)

UNREACHABLE = "no KV transfer backend in common with the decode worker"


class PrefillEngine(RoleEngineBase):
    role = WorkerRole.PREFILL

    def __init__(
        self, rt: RoleRuntime, transport: Transport, config: SchedulerConfig, worker_id: str
    ) -> None:
        self.rt = rt
        self.transport = transport
        self.worker_id = worker_id
        self.kv = rt.kv
        self.scheduler = PrefillScheduler(rt.kv, config)
        self.limits = rt.limits()
        self._requests: dict[str, Request] = {}
        self._targets: dict[str, KVTarget] = {}
        self._sending: dict[str, str] = {}  # transfer id -> request id (source blocks held)
        self._awaiting_target: set[str] = set()  # prefilled, blocks held, target not known yet
        self._pending_errors: list[TokenDelta] = []
        self.gate = GrammarGate(rt.grammars)
        self.transfers_failed = 0

    # -- commands ----------------------------------------------------------------------------
    def add(self, work: WorkItem, target: KVTarget | None = None) -> None:
        if work.request_id in self._requests:
            raise ValueError(f"request {work.request_id!r} is already on this worker")
        validate_request(work.prompt_token_ids, work.params, self.limits)
        self.gate.check_supported(work.params.constraint)
        req = Request(
            work.request_id, work.prompt_token_ids, work.params, self.rt.eos_ids, priority=work.priority
        )
        if target is not None:
            self._check_target(req, target)
        self.gate.hold(req, lambda: self.scheduler.add(req))  # raises if the constraint is refused
        if target is not None:
            self._targets[work.request_id] = target
        self._requests[work.request_id] = req

    def _check_target(self, req: Request, target: KVTarget) -> None:
        if len(target.blocks) * self.rt.block_size < req.num_prompt_tokens:
            raise ValueError(f"{len(target.blocks)} destination blocks cannot hold the prompt")

    def set_target(self, request_id: str, target: KVTarget) -> bool:
        """Name the decode blocks of a request added without them; False if it is gone."""
        req = self._requests.get(request_id)
        if req is None or request_id in self._targets:
            return False
        self._check_target(req, target)
        self._targets[request_id] = target
        if request_id in self._awaiting_target:
            self._awaiting_target.discard(request_id)
            if self._push(request_id, target, layerwise=False) is None:
                self.kv.free(request_id)
                self._end(request_id, cancel=False)
                self._pending_errors.append(error_delta(request_id, UNREACHABLE))
        return True

    def abort(self, request_id: str) -> bool:
        if request_id not in self._requests:
            return False
        if self.gate.drop(request_id):
            self._targets.pop(request_id, None)
            self._forget(request_id)
            return True
        target = self._targets.pop(request_id, None)
        if target is not None and target.transfer_id in self._sending:
            self.transport.cancel(target.transfer_id)  # blocks freed when the transport reports it
        elif request_id in self._awaiting_target:
            self._awaiting_target.discard(request_id)
            self.kv.free(request_id)
            self._forget(request_id)
        else:
            self.scheduler.remove(request_id)
            self._forget(request_id)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Give back a request that has not started (no block held, nothing computed): it leaves
        as if it had never come, and the router routes it again. False if it started, or is not
        here (both leave it as it was)."""
        if request_id not in self._requests:
            return False
        if not self.gate.drop(request_id) and self.scheduler.withdraw(request_id) is None:
            return False
        self._targets.pop(request_id, None)  # the router gives the decode reservation back
        self._forget(request_id)
        return True

    def _forget(self, request_id: str) -> Request | None:
        """The request leaves this worker: its entry and whatever the runner keeps for it."""
        self.rt.runner.release(request_id)
        return self._requests.pop(request_id, None)

    # -- stepping ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.num_waiting or self.scheduler.num_running)

    @property
    def has_pending_io(self) -> bool:
        return bool(self._sending or self._pending_errors or self.gate or self.transport.settling)

    @property
    def idle(self) -> bool:
        return not self._requests and not self._sending

    def request_state(self) -> dict[str, int]:
        return {
            **self.kv.request_state(),
            "requests": len(self._requests),
            "targets": len(self._targets),
            "sending": len(self._sending),
            "awaiting_target": len(self._awaiting_target),
            "grammar_wait": len(self.gate),
            "runner": self.rt.runner.kept_requests(),
            "scheduled": self.scheduler.num_waiting + self.scheduler.num_running,
            **self._transport_state(),
        }

    def step(self) -> list[TokenDelta]:
        deltas = self._reap_transfers()
        for req, why in self.gate.poll() if self.gate else ():
            self._targets.pop(req.request_id, None)
            self._forget(req.request_id)
            self._pending_errors.append(error_delta(req.request_id, why))
        if self._pending_errors:
            deltas += self._pending_errors
            self._pending_errors = []
        plan = self.scheduler.schedule()
        if plan.empty:
            return deltas
        chunks = plan.chunks
        unreachable: set[str] = set()
        pushes = []
        for c in chunks:
            target = self._targets.get(c.request_id)
            if c.sample and target is not None:
                tid = self._push(c.request_id, target, layerwise=True)
                if tid is None:
                    unreachable.add(c.request_id)
                else:
                    pushes.append(tid)

        def on_layer(i: int) -> None:
            for tid in pushes:
                self.transport.layer_ready(tid, i)

        result = self.rt.runner.execute(chunks, self._requests, on_layer if pushes else None)
        update = self.scheduler.update(plan, result.sampled)
        for req in update.prefilled:
            if req.request_id in unreachable:
                self.kv.free(req.request_id)
                self._end(req.request_id, cancel=False)
                deltas.append(error_delta(req.request_id, UNREACHABLE))
                continue
            if req.request_id not in self._targets:
                self._awaiting_target.add(req.request_id)
            lp = result.logprobs.get(req.request_id)
            deltas.append(delta_for(req, 0, [lp] if lp else [], prefilled=True))
        for req in update.finished:  # the first token ended it: decode never starts
            lp = result.logprobs.get(req.request_id)
            deltas.append(delta_for(req, 0, [lp] if lp else []))
            self._end(req.request_id, cancel=True)
        return deltas

    def _push(self, request_id: str, target: KVTarget, layerwise: bool) -> str | None:
        """Start pushing the prompt's KV; the transfer id, or ``None`` if the peer is unreachable."""
        src = self.kv.block_table(request_id)[: len(target.blocks)]
        try:
            self.transport.send(
                target.transfer_id,
                target.address,
                src,
                target.blocks,
                layerwise=layerwise,
                peer_offers=target.offers,
                peer_ranks=target.ranks,
            )
        except ValueError as e:  # no backend in common: fail the request, not the worker
            log.warning("%s: cannot push KV to %s: %s", request_id, target.address, e)
            return None
        self._sending[target.transfer_id] = request_id
        return target.transfer_id

    def _reap_transfers(self) -> list[TokenDelta]:
        done = self.transport.poll()
        deltas: list[TokenDelta] = []
        # sorted: a set's order follows the process's string hashing, and the order blocks are
        # freed in must not make two runs of the same workload differ
        for tid in sorted(done.finished_sending | set(done.failed)):
            rid = self._sending.pop(tid, None)
            self.transport.forget(tid)
            if rid is None:
                continue
            req = self._forget(rid)
            aborted = self._targets.pop(rid, None) is None
            if req is not None:
                self.kv.free(rid)
            if tid in done.failed and not aborted:
                self.transfers_failed += 1
                log.info("%s: KV push failed (%s); decode recomputes", rid, done.failed[tid].value)
                deltas.append(TokenDelta(rid, (), kv_lost=True))
        return deltas

    def _end(self, request_id: str, cancel: bool) -> None:
        target = self._targets.pop(request_id, None)
        self._forget(request_id)
        if target is not None and target.transfer_id in self._sending:
            self._sending.pop(target.transfer_id)
            if cancel:
                self.transport.cancel(target.transfer_id)

    def counts(self) -> tuple[int, int]:
        return self.scheduler.num_running + len(self._sending), self.scheduler.num_waiting
