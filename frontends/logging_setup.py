"""The one place the commands configure logging (structlog and stdlib) to stderr.

Loggers write to `_StderrProxy`, which looks `sys.stderr` up on every write instead of binding the
stream object at configuration time. A bound stream outlives whoever installed it: under pytest's
capture, a CLI run in-process would leave structlog holding a capture file that pytest closes after
the test, and every later structlog call in the same process would fail with "I/O operation on
closed file".
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


class _StderrProxy:
    """A write-only text stream that forwards to whatever `sys.stderr` is at call time."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


STDERR = _StderrProxy()


def configure_logging(verbose: bool, *, stdlib: bool = False, log_format: str = "text",
                      events: bool | None = None) -> None:
    """structlog to stderr (stdout stays the command's output); with `stdlib`, the root stdlib logger
    too (the server logs through `logging`).

    structlog's info events show with -v (DEBUG, console lines) or `--log-format json` (one JSON
    object per line); otherwise only warnings do, so a command's stderr reads like llama.cpp's.
    `events` forces them on or off whatever the flags say."""
    show = (verbose or log_format == "json") if events is None else events
    level = logging.DEBUG if verbose else logging.INFO if show else logging.WARNING
    renderer: Any = (structlog.processors.JSONRenderer() if log_format == "json"
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    if not stdlib:
        return
    root = logging.getLogger()
    if not any(getattr(h, "_spekula", False) for h in root.handlers):
        handler = logging.StreamHandler(STDERR)  # type: ignore[arg-type]
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._spekula = True  # type: ignore[attr-defined]  # marks ours: one handler however often called
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
