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

import structlog


class _StderrProxy:
    """A write-only text stream that forwards to whatever `sys.stderr` is at call time."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


STDERR = _StderrProxy()


def configure_logging(verbose: bool, *, stdlib: bool = False) -> None:
    """structlog to stderr (stdout stays the command's output), DEBUG with -v; with `stdlib`, the
    root stdlib logger too (the server logs through `logging`)."""
    level = logging.DEBUG if verbose else logging.INFO
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                    structlog.dev.ConsoleRenderer(colors=False)],
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
    root.setLevel(level)
