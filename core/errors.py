"""Errors that frontends turn into one clear message (no traceback soup)."""

from __future__ import annotations


class SpekulaError(Exception):
    """Base class for user-facing errors."""


class ModelFileError(SpekulaError):
    """A model file cannot be used: corrupt, truncated, unsupported architecture/tensor type, missing tensor."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class ConfigError(SpekulaError):
    """Bad options: unknown spec type, invalid parameter value, incompatible draft model."""


class ContextOverflowError(SpekulaError):
    """A prompt (plus what must follow it) does not fit in the context."""
