"""Token counts for the penalties, kept on the device between steps.

Rebuilding "which tokens did this request see, and how often did it emit each" from Python
lists every step costs an upload per row and grows with the output. Here each request with a
penalty keeps two vocabulary-sized rows on the device — ``seen`` (prompt ∪ output, for the
repetition penalty) and ``counts`` (output only, for the frequency and presence penalties) —
and the sampler adds each step's sampled token to them on the device (``advance``), with no
host read.

Contract: a record is valid for a request whose prompt and output lengths are the ones it
counted; otherwise (first step, a request resumed on another worker, a token the engine did
not keep) it is rebuilt from the request's token lists. ``release`` drops a request's record;
the owner calls it when the request ends, and ``len`` is the per-request state left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Record:
    seen: torch.Tensor  # [vocab] bool
    counts: torch.Tensor  # [vocab] float32
    prompt_len: int
    counted: int  # output tokens included


class PenaltyCounts:
    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def __len__(self) -> int:
        return len(self._records)

    def release(self, request_id: str) -> None:
        self._records.pop(request_id, None)

    def rows(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab: int,
        device: torch.device,
        pending: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``seen`` [n, vocab] bool and ``counts`` [n, vocab] float32 of these requests. An empty
        request id keeps no record (the rows are rebuilt every call). ``pending[i]``: tokens
        request ``i`` sampled on the device that ``outputs[i]`` lacks (an overlapped step); its
        record must count them, as it cannot be rebuilt without them."""
        seen, counts = [], []
        pend = pending if pending is not None else [0] * len(request_ids)
        for rid, prompt, output, ahead in zip(request_ids, prompts, outputs, pend, strict=True):
            rec = self._records.get(rid) if rid else None
            if rec is None or rec.prompt_len != len(prompt) or rec.counted != len(output) + ahead:
                if ahead:
                    raise RuntimeError(f"{rid}: penalty counts lack the token of the step in flight")
                rec = _build(prompt, output, vocab, device)
                if rid:
                    self._records[rid] = rec
            seen.append(rec.seen)
            counts.append(rec.counts)
        return torch.stack(seen), torch.stack(counts)

    def advance(self, request_ids: Sequence[str], tokens: torch.Tensor) -> None:
        """Count ``tokens`` (a device tensor, one per id) as emitted by these requests."""
        for i, rid in enumerate(request_ids):
            rec = self._records.get(rid)
            if rec is None:
                continue
            tok = tokens[i : i + 1]
            rec.counts.index_add_(0, tok, torch.ones(1, dtype=rec.counts.dtype, device=rec.counts.device))
            rec.seen.index_fill_(0, tok, True)
            rec.counted += 1


def _build(prompt: Sequence[int], output: Sequence[int], vocab: int, device: torch.device) -> _Record:
    ids = torch.tensor([*prompt, *output], dtype=torch.long, device=device)
    seen = torch.zeros(vocab, dtype=torch.bool, device=device)
    seen[ids] = True
    out = ids[len(prompt) :]
    counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, out, torch.ones(out.numel(), dtype=torch.float32, device=device))
    return _Record(seen, counts, len(prompt), len(output))
