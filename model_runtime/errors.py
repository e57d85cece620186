"""Errors the runtime raises on purpose, so callers can map them to API status codes.

``InvalidRequestError`` means the request is at fault (HTTP 400 / INVALID_ARGUMENT) and the
engine keeps serving; ``ModelLoadError`` means a checkpoint cannot be used and says why in one
line, never a traceback through torch internals.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class of every error raised on purpose by pdserve."""


class InvalidRequestError(PdserveError, ValueError):
    """A request parameter is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(PdserveError):
    """A model directory is missing, corrupt, unsupported, or does not fit the device."""


class TokenizerUnavailableError(InvalidRequestError):
    """A text prompt was sent to a model loaded without tokenizer files."""

    def __init__(self) -> None:
        super().__init__(
            "prompt",
            "this model was loaded without tokenizer files: send token ids instead of text",
        )
