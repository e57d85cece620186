"""``pdserve plan``'s candidate layouts: the families, their order, and how they rank (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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

    @property
    def gpus(self) -> int:
        return self.colocated or self.prefill + self.decode

    @property
    def canonical(self) -> tuple[int, int, int]:
        """Where the candidate stands in the search's fixed order (families as ``candidates``
        lists them, then fewer prefill workers, then the smaller budget): what breaks ties
        between equal goodputs, so the order candidates happened to finish in never matters."""
        return (_FAMILY_ORDER.index(self.family), self.prefill, self.budget)

    @property
    def family(self) -> str:
        if self.conditional:
            return CONDITIONAL
        return self.schedule if self.colocated else SPLIT

    @property
    def label(self) -> str:
        if self.conditional:
            shape = f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"
            return f"{shape} conditional, budget {self.budget}"
        if self.colocated:
            kind = "" if self.schedule == CHUNKED else f" {self.schedule}"
            return f"{self.colocated} colocated{kind}, budget {self.budget}"
        return f"{self.prefill}P+{self.decode}D, budget {self.budget}"

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
        }

    def serve_flags(self, profile: str, policy: str, slo: str) -> str:
        shape = (
            f"--colocated {self.colocated}"
            if self.colocated
            else f"--prefill {self.prefill} --decode {self.decode}"
        )
        if self.colocated and self.schedule != CHUNKED:
            shape += f" --colocated-schedule {self.schedule}"
        routing = "--policy goodput" if self.conditional else f"--policy {policy}"
        if not self.conditional and not self.colocated and policy == "goodput":
            routing += " --no-local-prefill"
        return (
            f"pdserve serve {shape} --max-num-batched-tokens {self.budget} {routing} --slo {slo}"
            f"  # profile {profile}"
        )


def splits(gpus: int, max_splits: int) -> list[int]:
    """Prefill worker counts to try: 1..gpus-1 with a stride that keeps about ``max_splits``."""
    stride = max(1, (gpus - 1) // max(1, max_splits))
    return list(range(1, gpus, stride))


def candidates(
    gpus: int,
    max_splits: int = 16,
    colocated_budgets: Sequence[int] = COLOCATED_BUDGETS,
    priority_budgets: Sequence[int] = (),
    prefill_budgets: Sequence[int] = PREFILL_BUDGETS,
) -> list[Candidate]:
    out = [Candidate(0, 0, gpus, b) for b in colocated_budgets]
    out += [Candidate(0, 0, gpus, b, PRIORITY) for b in priority_budgets]
    for p in splits(gpus, max_splits):
        out += [Candidate(p, gpus - p, 0, b) for b in prefill_budgets]
    return out


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
