"""Options a command adds only when its command line may use them.

The drafters' own options (`--spec-ngram-mod-n-max`, a plugin's, ...) come from the installed drafter
classes, and loading all of them costs `spekula generate` tens of milliseconds of start-up that a
command line without speculation never uses. A `DeferringParser` holds such options back as a step
that adds them, and runs the step before it parses a command line that may need them: one that gives
an option the parser does not know without them, or any of the step's trigger options (the rest of
its option group), and before it formats help or usage. Adding them is always correct; holding them
back only skips the work, so the test errs towards adding (an abbreviation or a value that starts with
a dash adds them too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class DeferringParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: list[tuple[frozenset[str], Callable[[], None]]] = []

    def defer(self, triggers: Iterable[str], add: Callable[[], None]) -> None:
        """Run `add` (which adds options to this parser) only before parsing a command line that gives one
        of `triggers` or an option unknown without it, or before formatting help."""
        self._deferred.append((frozenset(triggers), add))

    def add_deferred(self) -> None:
        while self._deferred:
            self._deferred.pop(0)[1]()

    def _may_need(self, args: Sequence[str], triggers: frozenset[str]) -> bool:
        for token in args:
            if token == "--":
                return False
            if not token.startswith("-") or self._negative_number_matcher.match(token):
                continue
            name = token.split("=", 1)[0]
            if name in triggers or name not in self._option_string_actions:
                return True
        return False

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if any(self._may_need(argv, triggers) for triggers, _ in self._deferred):
            self.add_deferred()
        return super().parse_known_args(argv, namespace)

    def format_usage(self) -> str:
        self.add_deferred()
        return super().format_usage()

    def format_help(self) -> str:
        self.add_deferred()
        return super().format_help()


def add_when_used(p: argparse.ArgumentParser, triggers: Iterable[str], add: Callable[[], None]) -> None:
    """`add` deferred on a DeferringParser (see the module docstring), run at once on any other parser."""
    if isinstance(p, DeferringParser):
        p.defer(triggers, add)
    else:
        add()
