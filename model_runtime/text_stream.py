"""Token ids -> the text a client sees: incremental detokenization plus stop strings.

Shared by the offline driver's output tracker (``pdserve.model_runtime.engine.output``) and the
router, so both cut text at a stop string the same way. Without a tokenizer it passes ids
through and produces no text.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.model_runtime.sampling.stop import StopStringMatcher
from pdserve.model_runtime.tokenizer import IncrementalDetokenizer, TextTokenizer


class TextStream:
    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        prompt_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt_ids)) if tokenizer else None
        self.stop = StopStringMatcher(stop, include_stop)
        self.text: str | None = "" if tokenizer else None
        self._finished = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one did."""
        return self.stop.matched

    def add(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Feed new ids; returns (text now safe to show, how many ids were taken). Once a stop
        string matched, later ids are not taken: they come after the end of the output."""
        if self.detok is None:
            return "", len(token_ids)
        out = ""
        taken = 0
        for t in token_ids:
            if self.stop.matched is not None:
                break
            out += self.stop.feed(self.detok.add(t))
            taken += 1
        self.text = (self.text or "") + out
        return out, taken

    def finish(self) -> str:
        """Generation ended: release held-back text (a partial character, a possible stop prefix)."""
        if self.detok is None or self._finished:
            return ""
        self._finished = True
        out = ""
        if self.stop.matched is None:
            out += self.stop.feed(self.detok.flush())
        out += self.stop.flush()
        self.text = (self.text or "") + out
        return out
