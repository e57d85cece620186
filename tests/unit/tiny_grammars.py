"""The ``tiny`` model's grammars (a byte vocabulary: every token one byte), which the
structured-output unit tests walk documents through."""

from __future__ import annotations

from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.tokenizer import TextTokenizer


def tiny_grammars() -> Grammars:
    ck = resolve_model("tiny")
    tok = TextTokenizer.load(ck)
    assert tok is not None
    cfg = ck.model_config()
    return Grammars(tok, cfg.vocab_size, cfg.eos_token_ids)
