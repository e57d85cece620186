"""Stop strings on detokenized text, across token boundaries (pure Python).

Text is fed delta by delta. A stop string may straddle any number of tokens, so the matcher
holds back the longest tail of the text that could still begin a stop string (never more than
``len(longest stop) - 1`` characters); ``flush`` releases it when generation ends otherwise.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text now safe to emit. Sets ``matched`` on a stop."""
        if self.matched is not None:
            return ""
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        if not self.stops:
            return self._emit_to(len(self.text))
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            idx, s = best
            self.matched = s
            end = idx + len(s) if self.include_stop else idx
            self.text = self.text[:end]
            return self._emit_to(end)
        return self._emit_to(max(self.emitted, len(self.text) - self._pending_prefix()))

    def _pending_prefix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        return self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> str:
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out
