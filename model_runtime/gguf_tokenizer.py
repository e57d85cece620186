"""A ``tokenizers.Tokenizer`` built from a GGUF file's metadata.

A GGUF carries its vocabulary as ``tokenizer.ggml.*`` arrays under llama.cpp's names, and
sometimes the original ``tokenizer.json`` whole (``tokenizer.huggingface.json``, used as is).
Two vocabulary kinds are built:

- ``gpt2``: byte-level BPE (Llama 3, Qwen2, SmolLM) from the tokens and merges, text split the way
  the vocabulary was trained (``tokenizer.ggml.pre``; GPT-2's split where the name is not known);
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral), merges recovered from the
  token scores.

Tokens marked *control* become special tokens and *user-defined* ones added tokens, so that a
rendered chat template's ``<|im_start|>`` is one id. BOS is prepended only when the file says so
(``tokenizer.ggml.add_bos_token``; SentencePiece vocabularies default to yes, as llama.cpp does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.tokenizer import bos_first, bytes_to_unicode

if TYPE_CHECKING:
    from pdserve.model_runtime.model.gguf import GGUFFile

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = TokenType.CONTROL, TokenType.USER_DEFINED  # llama.cpp's token types

# How text is split before BPE, by ``tokenizer.ggml.pre``: the regexes of those vocabularies'
# own tokenizer.json files.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {"llama3": _LLAMA3, "llama-bpe": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "qwen2": _QWEN2}
# Llama 3's vocabulary takes a word that is itself a token whole (its tokenizer.json's
# ``ignore_merges``) and starts every text with BOS; llama.cpp does both for these names.
LLAMA3_STYLE = ("llama3", "llama-bpe", "llama-v3", "smaug-bpe")
GPT2_SPLITS = ("default", "gpt-2", "gpt2", "smollm")  # GPT-2's own split (ByteLevel's regex)


def gguf_tokenizer(f: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer, or ``None`` when it carries none (token-id prompts only)."""
    embedded = f.value("tokenizer.huggingface.json")
    if isinstance(embedded, str) and embedded:
        try:
            return Tokenizer.from_str(embedded)
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise ModelLoadError(f"{f.path}: embedded tokenizer.json is invalid ({e})") from None
    kind = f.value("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens: list[str] = list(f.value("tokenizer.ggml.tokens") or [])
    types: list[int] = list(f.value("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{f.path}: {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        pre = str(f.value("tokenizer.ggml.pre") or "default")
        tok = _byte_level(tokens, types, list(f.value("tokenizer.ggml.merges") or []), pre)
        add_bos = bool(f.value("tokenizer.ggml.add_bos_token", pre in LLAMA3_STYLE))
    elif kind == "llama":
        scores = list(f.value("tokenizer.ggml.scores") or [])
        unk = f.value("tokenizer.ggml.unknown_token_id")
        tok = _sentencepiece(
            tokens, types, scores, unk, bool(f.value("tokenizer.ggml.add_space_prefix", True))
        )
        add_bos = bool(f.value("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelLoadError(f"{f.path}: tokenizer model {kind!r} is not supported (gpt2 or llama)")
    special = f.tokens_of_type(_CONTROL).values()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = f.tokens_of_type(_USER_DEFINED).values()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos_id = f.value("tokenizer.ggml.bos_token_id")
    steps: list[processors.PostProcessor] = []
    if kind == "gpt2":
        steps.append(processors.ByteLevel(trim_offsets=False))
    if add_bos and isinstance(bos_id, int) and 0 <= bos_id < len(tokens):
        steps.append(bos_first(tokens[bos_id], bos_id))
    if steps:
        tok.post_processor = processors.Sequence(steps)
    return tok


def _byte_level(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: str) -> Tokenizer:
    table = bytes_to_unicode()
    alphabet = set(table.values())

    def spelled(token: str, kind: int) -> str:
        # Normal tokens are stored in the byte alphabet; one that is not is re-spelled from its
        # UTF-8 bytes. Control and user-defined tokens keep their text: it is matched whole.
        if kind in (_CONTROL, _USER_DEFINED) or set(token) <= alphabet:
            return token
        return "".join(table[b] for b in token.encode("utf-8"))

    vocab = {spelled(t, k): i for i, (t, k) in enumerate(zip(tokens, types, strict=True))}
    pairs: list[tuple[str, str]] = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"GGUF merge {m!r} is not two tokens separated by a space")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in LLAMA3_STYLE))
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in GPT2_SPLITS:
            log.warning("GGUF pre-tokenizer %r is not known; splitting text as GPT-2 does", pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    the merges of higher-scoring tokens first."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[index], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _sentencepiece(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], unk: object, prefix_space: bool
) -> Tokenizer:
    if len(scores) != len(tokens):
        raise ModelLoadError(f"SentencePiece vocabulary has {len(tokens)} tokens but {len(scores)} scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(vocab, scores),
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok
