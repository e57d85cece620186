"""Token classes every constrained row is also masked by, read once from the vocabulary.

The grammar engine matches text as Unicode code points over UTF-8, but two of its gaps would
reach a client as invalid output with a 200:

- control bytes: JSON allows none outside a string's escapes (and the output has no
  whitespace but the separators' spaces), yet the engine's grammar for strings with a
  ``maxLength`` (and some patterns) admits raw control characters, which strict JSON parsers
  refuse: JSON rows take no token holding a byte below 0x20 (``json_safe``);
- surrogates and the like: after a lead byte whose first continuation byte is narrower than
  80-BF (E0: A0-BF, ED: 80-9F — past it lie the UTF-16 surrogates —, F0: 90-BF, F4: 80-8F),
  the engine admits any continuation, and the detokenized text gets U+FFFD where the bytes
  were: a row whose last token ends on such a lead byte takes only tokens starting in its range
  (``after``), on byte-level vocabularies where one token can end mid-character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Lead bytes whose first continuation byte is narrower than 80-BF (RFC 3629's table).
NARROW_LEADS = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _row(bits: np.ndarray) -> torch.Tensor:
    """A bool per token -> one packed bitmask row ([words] int32)."""
    words = (len(bits) + 31) // 32
    padded = np.zeros(words * 32, dtype=bool)
    padded[: len(bits)] = bits
    return torch.from_numpy(
        np.packbits(padded.reshape(words, 32), axis=1, bitorder="little").view(np.int32).reshape(words).copy()
    )


@dataclass(frozen=True)
class VocabMasks:
    json_safe: torch.Tensor  # [words]: tokens with no control byte
    after: dict[int, torch.Tensor]  # narrow lead byte -> [words]: tokens that may follow it
    ends_on_lead: np.ndarray  # per token: the narrow lead byte it ends on, else 0

    @staticmethod
    def build(pieces: Sequence[bytes]) -> VocabMasks:
        """From each token's bytes (``TokenizerInfo.decoded_vocab``, one per logit)."""
        n = len(pieces)
        first = np.full(n, -1, dtype=np.int32)
        last = np.zeros(n, dtype=np.int32)
        safe = np.ones(n, dtype=bool)
        for i, p in enumerate(pieces):
            if p:
                first[i] = p[0]
                last[i] = p[-1] if p[-1] in NARROW_LEADS else 0
                safe[i] = min(p) >= 0x20
        after = {lead: _row((first >= lo) & (first <= hi)) for lead, (lo, hi) in NARROW_LEADS.items()}
        return VocabMasks(_row(safe), after, last)

    def restrict(self, row: torch.Tensor, last_token: int, json: bool) -> None:
        """AND ``row`` (one bitmask row, in place) with the classes a row after ``last_token``
        (-1: none yet) may take."""
        if json:
            row &= self.json_safe
        if last_token >= 0:
            lead = int(self.ends_on_lead[last_token])
            if lead:
                row &= self.after[lead]
