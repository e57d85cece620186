"""``pdserve plan``'s candidate layouts: the families, their order, and how they rank (pure).

A layout's workers may span several GPUs each (tensor parallelism, one degree per pool; colocated
engines take the decode degree): a candidate holds ``prefill · prefill_tp + decode · decode_tp``
GPUs, at most the plan's (a remainder too small for another worker stays idle, and goodput per
GPU counts it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.flags import layout_label

COLOCATED_BUDGETS = (512, 2048, 8192)
PRIORITY_BUDGETS = (2048, 8192)
PREFILL_BUDGETS = (2048, 8192)
CHUNKED, PRIORITY, SPLIT, CONDITIONAL = "chunked", "prefill-priority", "split", "conditional"
_FAMILY_ORDER = (CHUNKED, PRIORITY, SPLIT, CONDITIONAL)


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    colocated: int
    budget: int  # tokens per step: the colocated chunk budget, or the prefill workers' budget
    schedule: str = CHUNKED  # colocated only: "chunked" or "prefill-priority"
    conditional: bool = False  # the goodput policy with local prefill (on a split or colocated)
    prefill_tp: int = 1  # GPUs each prefill worker spans
    decode_tp: int = 1  # GPUs each decode worker (colocated engine) spans

    @property
    def gpus(self) -> int:
        if self.colocated:
            return self.colocated * self.decode_tp
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def equal_tp(self) -> bool:
        """One degree everywhere (colocated engines always)."""
        return bool(self.colocated) or self.prefill_tp == self.decode_tp

    @property
    def canonical(self) -> tuple[int, ...]:
        """Where the candidate stands in the search's fixed order (families as ``candidates``
        lists them, then fewer prefill workers, then the smaller budget, then the smaller
        degrees): what breaks ties between equal goodputs, so the order candidates happened to
        finish in never matters."""
        return (_FAMILY_ORDER.index(self.family), self.prefill, self.budget, self.prefill_tp, self.decode_tp)

    @property
    def family(self) -> str:
        if self.conditional:
            return CONDITIONAL
        return self.schedule if self.colocated else SPLIT

    @property
    def label(self) -> str:
        shape = layout_label(self.prefill, self.decode, self.colocated, self.prefill_tp, self.decode_tp)
        if self.conditional:
            return f"{shape} conditional, budget {self.budget}"
        if self.colocated:
            kind = "" if self.schedule == CHUNKED else f" {self.schedule}"
            return f"{shape}{kind}, budget {self.budget}"
        return f"{shape}, budget {self.budget}"

    def sim_args(self, policy: str) -> dict[str, Any]:
        """How ``simulate`` runs this candidate (static layouts use the plan's ``--policy``)."""
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "colocated": self.colocated,
            "max_num_batched_tokens": self.budget,
            "decode_max_num_batched_tokens": 0,
            "colocated_schedule": self.schedule,
            "policy": "goodput" if self.conditional else policy,
            "local_prefill": self.conditional,
            "prefill_tp": self.decode_tp if self.colocated else self.prefill_tp,
            "decode_tp": self.decode_tp,
        }

    def serve_flags(self, profile: str, policy: str, slo: str) -> str:
        shape = (
            f"--colocated {self.colocated}"
            if self.colocated
            else f"--prefill {self.prefill} --decode {self.decode}"
        )
        if self.colocated and self.schedule != CHUNKED:
            shape += f" --colocated-schedule {self.schedule}"
        if self.colocated and self.decode_tp > 1:
            shape += f" --decode-tp {self.decode_tp}"
        elif not self.colocated and (self.prefill_tp, self.decode_tp) != (1, 1):
            shape += f" --prefill-tp {self.prefill_tp} --decode-tp {self.decode_tp}"
        routing = "--policy goodput" if self.conditional else f"--policy {policy}"
        if not self.conditional and not self.colocated and policy == "goodput":
            routing += " --no-local-prefill"
        return (
            f"pdserve serve {shape} --max-num-batched-tokens {self.budget} {routing} --slo {slo}"
            f"  # profile {profile}"
        )


def most_prefill(gpus: int, prefill_tp: int = 1, decode_tp: int = 1) -> int:
    """The most prefill workers that leave room for one decode worker."""
    return max(0, (gpus - decode_tp) // prefill_tp)


def splits(gpus: int, max_splits: int, prefill_tp: int = 1, decode_tp: int = 1) -> list[int]:
    """Prefill worker counts to try: 1..``most_prefill`` with a stride that keeps about
    ``max_splits`` (in GPUs: workers of several GPUs take the stride of one GPU each)."""
    gpu_stride = (gpus - 1) // max(1, max_splits)
    stride = max(1, -(-gpu_stride // prefill_tp))
    return list(range(1, most_prefill(gpus, prefill_tp, decode_tp) + 1, stride))


def split(
    gpus: int, prefill: int, budget: int, prefill_tp: int = 1, decode_tp: int = 1, **kw: Any
) -> Candidate:
    """``prefill`` workers of ``prefill_tp`` GPUs, and as many decode workers of ``decode_tp``
    as the rest of ``gpus`` holds."""
    decode = (gpus - prefill * prefill_tp) // decode_tp
    return Candidate(prefill, decode, 0, budget, prefill_tp=prefill_tp, decode_tp=decode_tp, **kw)


def candidates(
    gpus: int,
    max_splits: int = 16,
    colocated_budgets: Sequence[int] = COLOCATED_BUDGETS,
    priority_budgets: Sequence[int] = (),
    prefill_budgets: Sequence[int] = PREFILL_BUDGETS,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> list[Candidate]:
    """The first pass: colocated engines of ``decode_tp`` GPUs per budget, and the splits."""
    engines = gpus // decode_tp
    out = [Candidate(0, 0, engines, b, decode_tp=decode_tp) for b in colocated_budgets] if engines else []
    out += [Candidate(0, 0, engines, b, PRIORITY, decode_tp=decode_tp) for b in priority_budgets if engines]
    for p in splits(gpus, max_splits, prefill_tp, decode_tp):
        out += [split(gpus, p, b, prefill_tp, decode_tp) for b in prefill_budgets]
    return out


def tp_neighbours(best: Candidate, gpus: int, degrees: Sequence[tuple[int, int]]) -> list[Candidate]:
    """``best``'s layout at other degrees ``(prefill_tp, decode_tp)``, its budget and routing:
    either pool's GPUs held (as near as workers of the new degree come) and the other pool on
    what is left. Two layouts a pair at most: each is a goodput search."""
    pg, dg = best.prefill * best.prefill_tp, best.decode * best.decode_tp
    out: list[Candidate] = []
    for pt, dt in degrees:
        np_, nd = _near(pg, pt), _near(dg, dt)
        for p, d in ((np_, (gpus - np_ * pt) // dt), ((gpus - nd * dt) // pt, nd)):
            c = Candidate(p, d, 0, best.budget, conditional=best.conditional, prefill_tp=pt, decode_tp=dt)
            if p >= 1 and d >= 1 and c not in out:
                out.append(c)
    return out


def _near(held: int, tp: int) -> int:
    """Workers of ``tp`` GPUs nearest ``held`` GPUs (at least one)."""
    return max(1, (held + tp // 2) // tp)


Row = tuple[float, Candidate, dict[str, Any]]


def rank(row: Row) -> tuple[float, tuple[int, ...]]:
    """Higher goodput per GPU first; among equals, the earlier candidate in the fixed order."""
    per_gpu, c, _ = row
    return (per_gpu, tuple(-x for x in c.canonical))


def coarse_to_fine(items: Sequence[Candidate]) -> list[Candidate]:
    """``items`` in the order a bisection of their index range visits them (the middle, then
    the quarters, ...): measured in this order, a family's best shows up early, so warm starts
    and pruning work for the rest. The set is unchanged."""
    out: list[Candidate] = []
    spans = [(0, len(items))]
    while spans:
        nxt = []
        for a, b in spans:
            if a < b:
                m = (a + b) // 2
                out.append(items[m])
                nxt += [(a, m), (m + 1, b)]
        spans = nxt
    return out
