"""Finding the package's own compiled C libraries (loaded with ctypes, not imported)."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

from .errors import ConfigError


def extension_path(folder: Path, stem: str, what: str, advice: str = "") -> Path:
    """The built `stem*.so` (any extension suffix of this interpreter) in `folder`, or a ConfigError
    naming `what` is missing and how to build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{what} not built (no {stem}*.so in {folder}); reinstall the package with a C compiler "
                      f"present (pip install -e .){advice}")
