"""Where a model's files are and what they say: a Hugging Face directory (``config.json`` +
``*.safetensors``) or one GGUF file (given itself, or as the only ``*.gguf`` in a directory).

Everything that reads a model's files asks a ``Checkpoint``: the engine for its shape and
weights, the router for its tokenizer, chat template and generation defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.generation_config import (
    GGUF_KEYS,
    GenerationConfig,
    gguf_generation_config,
    merged,
    read_generation_config,
)


class Format(enum.Enum):
    HF = "hf"
    GGUF = "gguf"


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # HF: the directory; GGUF: the file
    format: Format

    @property
    def directory(self) -> Path:
        """The folder holding the files beside the weights (tokenizer, generation config)."""
        return self.path if self.format is Format.HF else self.path.parent

    @property
    def name(self) -> str:
        return self.path.stem if self.format is Format.GGUF else self.path.name

    @staticmethod
    def at(path: Path) -> Checkpoint:
        """Classify ``path``; a one-line ``ModelLoadError`` when it is neither kind."""
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(f"{path}: a model is a Hugging Face directory or a .gguf file")
            return Checkpoint(path, Format.GGUF)
        if not path.is_dir():
            raise ModelLoadError(f"{path}: no such model file or directory")
        if (path / "config.json").exists():
            return Checkpoint(path, Format.HF)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Checkpoint(ggufs[0], Format.GGUF)
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ModelLoadError(f"{path}: several GGUF files ({names}); name the one to serve")
        raise ModelLoadError(f"{path}: no config.json and no .gguf file (not a model directory)")

    def generation_config(self) -> GenerationConfig:
        beside = read_generation_config(self.directory)
        if self.format is Format.HF:
            return beside
        from gguf import TokenType

        from pdserve.model_runtime.model.gguf import open_gguf

        f = open_gguf(self.path)
        metadata = {k: f.value(k) for k in GGUF_KEYS}
        control = f.tokens_of_type(TokenType.CONTROL)
        return merged(beside, gguf_generation_config(metadata, str(self.path), control))

    def model_config(self) -> ModelConfig:
        """The model's shape, with every end-of-sequence id the checkpoint names."""
        if self.format is Format.HF:
            config = ModelConfig.from_file(self.path / "config.json")
        else:
            from pdserve.model_runtime.model.gguf import open_gguf

            config = open_gguf(self.path).model_config()
        eos = tuple(sorted(set(config.eos_token_ids) | set(self.generation_config().eos_token_ids)))
        return replace(config, eos_token_ids=eos)
