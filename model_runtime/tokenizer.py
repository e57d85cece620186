"""Tokenizers: ``tokenizer.json`` through the ``tokenizers`` library, a byte-level one for presets,
and incremental detokenization that never emits half of a multi-byte UTF-8 character."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from pdserve.model_runtime.chat_template import BUILT_IN, ChatTemplateSource, find_chat_template
from pdserve.model_runtime.checkpoint import Checkpoint, Format
from pdserve.model_runtime.errors import ModelLoadError

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that byte-level BPE vocabularies use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def byte_level_tokenizer() -> Tokenizer:
    """Ids 0-255 are bytes, then ``<s>`` 256, ``</s>`` 257, ``<pad>`` 258; BOS is prepended."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab.update({BOS: 256, EOS: 257, PAD: 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])
    tok.post_processor = bos_first(BOS, 256)
    return tok


def bos_first(bos: str, bos_id: int) -> processors.TemplateProcessing:
    """The post-processor that starts every encoded text (and each of a pair) with ``bos``."""
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplateSource | None = None) -> None:
        self._tok = tokenizer
        self.chat = chat or BUILT_IN
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> Tokenizer:
        """The ``tokenizers`` object (what the grammar engine reads the vocabulary from)."""
        return self._tok

    @staticmethod
    def load(checkpoint: Checkpoint) -> TextTokenizer | None:
        """The checkpoint's tokenizer and chat template, or ``None`` when it ships no tokenizer
        (token-id prompts only)."""
        if checkpoint.format is Format.GGUF:
            from pdserve.model_runtime.gguf_tokenizer import gguf_tokenizer
            from pdserve.model_runtime.model.gguf import open_gguf

            f = open_gguf(checkpoint.path)
            tok = gguf_tokenizer(f)
            if tok is None:
                return None
            template = f.value("tokenizer.chat_template")
            origin = f"{checkpoint.path.name} (tokenizer.chat_template)"
            bos, eos = (_token(tok, f.value(f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos"))
            chat = find_chat_template(checkpoint.directory, template, origin, bos, eos)
            return TextTokenizer(tok, chat)
        path = checkpoint.path / "tokenizer.json"
        if not path.exists():
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from None
        return TextTokenizer(tok, find_chat_template(checkpoint.path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: what the tokenizer adds around a text (BOS), not whether
        special tokens written in the text are recognised (they always are)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_str(self, token_id: int) -> str:
        """One token as text for logprobs; a token that is part of a multi-byte character (it
        decodes to U+FFFD alone) is shown in its vocabulary spelling, so distinct ids stay
        distinct."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            raw = self._tok.id_to_token(token_id)
            return raw if raw is not None else f"token_id:{token_id}"
        return text


def _token(tok: Tokenizer, token_id: object) -> str:
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        return tok.id_to_token(token_id) or ""
    return ""


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas.

    Decodes a short window (``prefix_offset``..end) and emits only what the newest ids added,
    holding back while the text ends in U+FFFD: the ids so far end inside a multi-byte
    character, and the next id completes it.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_tail: list[int] | None = None) -> None:
        self.tok = tokenizer
        # A little prompt context makes tokenizers that strip leading spaces decode correctly.
        self.ids: list[int] = list(prompt_tail or [])[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a truncated character at the very end decodes as U+FFFD)."""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]
