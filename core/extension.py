"""Finding the package's own compiled C libraries: the kernels loaded with ctypes, and the drafters'
extension modules imported as Python modules."""

from __future__ import annotations

import importlib
import importlib.machinery
from pathlib import Path
from types import ModuleType

from spekula.core.errors import ConfigError


def _missing(folder: Path, stem: str, what: str, advice: str = "") -> ConfigError:
    return ConfigError(f"{what} not built (no {stem}*.so in {folder}); reinstall the package with a C compiler "
                       f"present (pip install -e .){advice}")


def extension_path(folder: Path, stem: str, what: str, advice: str = "") -> Path:
    """The built `stem*.so` (any extension suffix of this interpreter) in `folder`, or a ConfigError
    naming `what` is missing and how to build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    raise _missing(folder, stem, what, advice)


def import_extension(package: str, stem: str, folder: Path, what: str) -> ModuleType:
    """The extension module `package.stem`, or a ConfigError naming `what` is missing and how to
    build it."""
    try:
        return importlib.import_module(f"{package}.{stem}")
    except ImportError as exc:
        raise _missing(folder, stem, what, f" ({exc})") from None
