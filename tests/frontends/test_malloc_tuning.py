"""The server pins glibc's mmap threshold so near-limit request lines do not raise its memory floor."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from spekula.frontends.malloc_tuning import THRESHOLD_BYTES, pin_mmap_threshold

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt's mmap threshold is a glibc setting")
def test_threshold_is_pinned_on_glibc() -> None:
    # In a child process: the setting is process-wide and the test process keeps its own.
    code = "from spekula.frontends.malloc_tuning import pin_mmap_threshold as p; print(p())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr


def test_users_own_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert pin_mmap_threshold() is False


def test_threshold_sits_below_the_request_line_limit() -> None:
    from spekula.frontends.rpc.framing import DEFAULT_MAX_LINE_BYTES

    # Buffers near the line limit must be mmapped (returned on free), or the fix does nothing for them.
    assert THRESHOLD_BYTES < DEFAULT_MAX_LINE_BYTES
