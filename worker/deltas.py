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


def coalesce(deltas: Sequence[TokenDelta]) -> list[TokenDelta]:
    """``deltas`` (several steps' worth, in step order) with each request's consecutive token
    deltas joined into one: a collect that gathered k steps sends each running request one
    delta of k tokens, so the router detokenizes, checks stop strings and writes to the client
    once per request instead of once per token. Deltas that say more than "tokens" (prefill's
    first token, a lost KV, an error) are kept as they are and end a run; a request's order is
    kept, and a joined delta takes the place of the run's first."""
    out: list[TokenDelta | list[TokenDelta]] = []
    open_runs: dict[str, list[TokenDelta]] = {}  # request id -> its run still taking deltas
    for d in deltas:
        plain = not (d.prefilled or d.kv_lost) and d.error is None
        run = open_runs.get(d.request_id) if plain else None
        if run is not None and (run[0].logprobs is None) == (d.logprobs is None):
            run.append(d)
        else:
            run = [d]
            out.append(run if plain else d)
        if plain and not d.finished:
            open_runs[d.request_id] = run
        else:
            open_runs.pop(d.request_id, None)
    return [x if isinstance(x, TokenDelta) else _joined(x) for x in out]


def _joined(run: list[TokenDelta]) -> TokenDelta:
    if len(run) == 1:
        return run[0]
    last = run[-1]
    logprobs = None if last.logprobs is None else tuple(p for d in run for p in d.logprobs or ())
    return TokenDelta(
        request_id=last.request_id,
        token_ids=tuple(t for d in run for t in d.token_ids),
        logprobs=logprobs,
        finished=last.finished,
        finish_reason=last.finish_reason,
        stop_token_id=last.stop_token_id,
        num_cached_tokens=max(d.num_cached_tokens for d in run),
    )
