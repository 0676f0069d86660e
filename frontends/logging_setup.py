"""The one place the commands configure logging (structlog and stdlib) to stderr.

Loggers write to `_StderrProxy`, which looks `sys.stderr` up on every write instead of binding the
stream object at configuration time. A bound stream outlives whoever installed it: under pytest's
capture, a CLI run in-process would leave structlog holding a capture file that pytest closes after
the test, and every later structlog call in the same process would fail with "I/O operation on
closed file".

The first import of structlog in a CLI process goes through `_structlog_without_rich` (main.py
imports this module before any command): structlog imports rich, when it is installed, for its
fancy tracebacks: ~70 ms, a tenth of `spekula generate`'s imports, for a renderer the CLI does not use.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

# Optional packages structlog imports at its own import for its exception renderers.
_STRUCTLOG_EXTRAS = ("rich", "better_exceptions")


def _structlog_without_rich() -> ModuleType:
    """structlog, imported (if nobody did yet) while its optional renderers look absent: its console
    lines then format tracebacks as plain text, as `configure_logging` asks anyway. The packages stay
    importable for whoever uses them later (textual, the training progress bar)."""
    hidden = [name for name in _STRUCTLOG_EXTRAS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import rich` raises ImportError
    try:
        import structlog
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return structlog


structlog = _structlog_without_rich()


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
                     else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback))
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
