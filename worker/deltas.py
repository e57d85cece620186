"""Request state -> ``TokenDelta`` (shared by both roles)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.worker.messages import TokenDelta


def delta_for(
    req: Request, since: int, logprobs: Sequence[Logprob] = (), prefilled: bool = False
) -> TokenDelta:
    """Tokens ``req`` generated from output index ``since`` on, and whether it ended."""
    stop_id = req.stop_reason if isinstance(req.stop_reason, int) else None
    return TokenDelta(
        request_id=req.request_id,
        token_ids=tuple(req.output_token_ids[since:]),
        logprobs=tuple(logprobs) if req.params.logprobs is not None else None,
        finished=req.is_finished,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        stop_token_id=stop_id,
        num_cached_tokens=req.num_cached_tokens,
        prefilled=prefilled,
    )


def error_delta(request_id: str, message: str) -> TokenDelta:
    return TokenDelta(request_id, (), finished=True, finish_reason="error", error=message)
