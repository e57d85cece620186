"""The text a client sees: incremental detokenization across multi-byte characters, stop strings."""

from __future__ import annotations

from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.text_stream import TextStream
from pdserve.model_runtime.tokenizer import TextTokenizer

TEXT = "héllo, 世界 🚀 ok"


def tokenizer() -> TextTokenizer:
    tok = TextTokenizer.load(resolve_model("tiny"))
    assert tok is not None
    return tok


def test_one_token_at_a_time_never_splits_a_character() -> None:
    tok = tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # byte-level: the multi-byte characters span several ids
    stream = TextStream(tok, [])
    pieces = [stream.add([t])[0] for t in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # no half character was ever shown


def test_stop_string_across_tokens_cuts_the_text_and_the_ids() -> None:
    tok = tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tok, [], stop=("世界",))
    text, taken = stream.add(ids)
    text += stream.finish()
    assert text == "héllo, " and stream.matched == "世界"
    assert taken < len(ids)  # ids after the stop are not part of the output
