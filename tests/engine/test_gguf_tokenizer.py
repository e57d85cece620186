"""Tokenizers and chat templates from GGUF metadata, against transformers reading the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.model_runtime.checkpoint import Checkpoint
from pdserve.model_runtime.gguf_tokenizer import sentencepiece_merges
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.chat import ChatMessage, ChatTemplate
from tests.engine.gguf_files import gguf, hf_model, smollm2_path, smollm2_reference, transformers, write_gguf

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\ttabbed",
    "numbers 1234567 and 3.14159, dates 2026-12-01",
    "unicode: café, naïve, 東京, emoji 🙂🚀",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm you're we've they'll she'd",
    "",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name three colours."},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Explain\nbriefly."},
    ],
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[TextTokenizer, Any]:
    ours = TextTokenizer.load(Checkpoint.at(smollm2_path()))
    assert ours is not None
    return ours, smollm2_reference()[1]


def test_smollm2_encodes_like_transformers(smollm2: tuple[TextTokenizer, Any]) -> None:
    ours, ref = smollm2
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_smollm2_chat_prompt_ids_equal_apply_chat_template(smollm2: tuple[TextTokenizer, Any]) -> None:
    ours, ref = smollm2
    template = ChatTemplate.of(ours)
    assert template.origin.found and "tokenizer.chat_template" in template.origin.origin
    for conversation in CONVERSATIONS:
        expected = ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if not isinstance(expected, list) else expected)
        got = template.prompt_ids([ChatMessage(m["role"], m["content"]) for m in conversation])
        assert got == expected, conversation
        assert got.count(1) == sum(1 for _ in conversation) + (conversation[0]["role"] != "system") + 1


def test_template_beside_the_gguf_overrides_the_embedded_one(tmp_path: Path) -> None:
    tokens = [*(chr(0x100 + i) for i in range(256))]
    tokens[:3] = ["<unk>", "<s>", "</s>"]
    tokens += [f"t{i}" for i in range(64)]
    metadata = {"tokenizer.chat_template": "{{ bos_token }}embedded"}
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama"), "F16", tokens=tokens, metadata=metadata)
    tok = TextTokenizer.load(Checkpoint.at(path))
    assert tok is not None and tok.chat.template == "{{ bos_token }}embedded"
    (tmp_path / "chat_template.jinja").write_text("beside {{ messages[0]['content'] }}")
    tok = TextTokenizer.load(Checkpoint.at(path))
    assert tok is not None and tok.chat.origin.endswith("chat_template.jinja")
    assert ChatTemplate.of(tok).render([ChatMessage("user", "hi")]) == "beside hi"


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256)]
    pieces = ["▁", "e", "l", "o", "h", "t", "a", "r", "w", "d", "n", "i", "s", ",", "!",
              "ll", "he", "▁t", "▁h", "▁w", "or", "llo", "▁the", "hello", "▁hello", "▁world",
              "in", "is", "▁is", "an", "▁an", "er", "ld", "▁wor", "▁a"]  # fmt: skip
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, scores, types


def test_sentencepiece_gguf_encodes_like_transformers(tmp_path: Path) -> None:
    tokens, scores, types = _spm_vocab()
    model = hf_model("llama", vocab_size=len(tokens))
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del model
    from pdserve.model_runtime.gguf_tokenizer import gguf_tokenizer
    from pdserve.model_runtime.model.gguf import open_gguf

    ours = gguf_tokenizer(open_gguf(path))
    assert ours is not None
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "the hello, is an world!", " hello  world", "héllo wörld ✓", "hi\nthere"]:
        expected = ref(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert ours.decode(expected) == ref.decode(expected, skip_special_tokens=True), text


def test_sentencepiece_merges_prefer_higher_scores() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -0.5]
    merges = sentencepiece_merges(vocab, scores)
    assert merges.index(("b", "c")) < merges.index(("a", "b"))
    assert merges[0] in {("a", "bc"), ("ab", "c")}


def test_llama3_style_vocabularies_take_whole_words_and_add_bos(tmp_path: Path) -> None:
    """Llama 3's tokenizer.json sets ignore_merges (a word that is a token is taken whole) and
    starts every text with BOS; a GGUF saying pre-tokenizer "llama-bpe" gets both."""
    from pdserve.model_runtime.gguf_tokenizer import gguf_tokenizer
    from pdserve.model_runtime.model.gguf import open_gguf
    from pdserve.model_runtime.tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = ["<|begin_of_text|>", "<|end_of_text|>", *alphabet, "he", "hello"]
    types = [3, 3, *([1] * len(alphabet)), 1, 1]
    for pre, whole, bos in (("llama-bpe", True, True), ("default", False, False)):
        path = tmp_path / f"{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(["h e"])
        w.add_uint32("tokenizer.ggml.bos_token_id", 0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = gguf_tokenizer(open_gguf(path))
        assert tok is not None
        ids = tok.encode("hello").ids
        assert (ids[0] == 0) is bos, (pre, ids)
        assert (ids[-1] == tokens.index("hello")) is whole, (pre, ids)
