"""From sampled tokens to what a client sees: text deltas, stop strings, logprobs, usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.model_runtime.request import FinishReason, Request, Usage
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.text_stream import TextStream
from pdserve.model_runtime.tokenizer import TextTokenizer


@dataclass
class RequestOutput:
    """A request's progress after one step. ``new_*`` hold what this step added."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int]
    text: str | None
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    usage: Usage
    logprobs: list[Logprob] | None = None
    new_logprobs: list[Logprob] = field(default_factory=list)
    num_preemptions: int = 0


class OutputTracker:
    """Per-request detokenization and stop-string state; owned by ``OfflineDriver``."""

    def __init__(self, req: Request, tokenizer: TextTokenizer | None) -> None:
        self.req = req
        self.stream = TextStream(
            tokenizer, req.prompt_token_ids, req.params.stop, req.params.include_stop_str_in_output
        )
        self.logprobs: list[Logprob] | None = [] if req.params.logprobs is not None else None
        self.seen = 0  # output tokens already reported

    def step(self, logprobs: Logprob | None) -> tuple[RequestOutput, bool]:
        """Report tokens added since the last call; returns (output, hit a stop string)."""
        req = self.req
        new_ids = req.output_token_ids[self.seen :]
        self.seen = len(req.output_token_ids)
        new_text, _ = self.stream.add(new_ids)
        if req.is_finished or self.stream.matched is not None:
            new_text += self.stream.finish()
        hit_stop = self.stream.matched is not None
        new_lp: list[Logprob] = []
        if self.logprobs is not None and logprobs is not None:
            new_lp = [logprobs]
            self.logprobs.append(logprobs)
        return self.output(new_ids, new_text, new_lp), hit_stop

    def output(self, new_ids: list[int], new_text: str, new_lp: list[Logprob]) -> RequestOutput:
        req = self.req
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self.stream.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            usage=Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens),
            logprobs=self.logprobs,
            new_logprobs=new_lp,
            num_preemptions=req.num_preemptions,
        )

    def finish_on_stop_string(self) -> None:
        self.req.finish(FinishReason.STOP_STRING, stop_reason=self.stream.matched)
