"""Drafter registry: llama.cpp's spec-type names mapped to classes through entry points.

Drafters are found only through the ``spekula.drafters`` entry-point group, so a third-party
distribution adds a technique by declaring an entry point; nothing in spekula names it. An engine
may also be handed drafter classes or instances directly (tests, benchmarks): those shadow entry
points of the same name.

Priority (docs/semantics.md §3): the user's order never matters. Built-in draftless types
come first in their fixed order, then third-party draftless types (by name), then the built-in
model types, then third-party model-based types (by name).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.errors import ConfigError, SpekulaError
from spekula.core.params import SPEC_TYPE_PRIORITY

ENTRY_POINT_GROUP = "spekula.drafters"
# The first five built-in names are the draftless (n-gram) ones.
_N_BUILTIN_DRAFTLESS = 5

DrafterSource = type | Drafter  # a class with create(ctx), or a ready instance


def available_drafters() -> dict[str, EntryPoint]:
    """Every drafter name declared in the entry-point group (first declaration of a name wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def _available_text(extra: Mapping[str, Any] | None = None) -> str:
    names = set(available_drafters()) | set(extra or ())
    return ", ".join(["none", *sorted(names, key=lambda n: priority_key(n, False))])


def parse_spec_types(values: Iterable[str], extra: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Accumulated --spec-type values (each a comma list) -> distinct names, in priority order.

    A ``none`` inside one comma list collapses that list (llama.cpp); unknown names are errors.
    Third-party names are ordered as draftless here; `order_drafters` refines that once the
    classes are loaded and their `model_based` flag is known.
    """
    known = set(available_drafters()) | set(extra or ()) | set(SPEC_TYPE_PRIORITY)
    chosen: dict[str, None] = {}
    for value in values:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        if "none" in names:
            continue
        for name in names:
            if name not in known:
                raise ConfigError(f"unknown spec type {name!r}; available: {_available_text(extra)}")
            chosen[name] = None
    return tuple(sorted(chosen, key=lambda n: priority_key(n, False)))


def priority_key(name: str, model_based: bool) -> tuple[int, int, str]:
    """Sort key placing `name` per docs/semantics.md §3, third-party names by their `model_based` flag."""
    if name in SPEC_TYPE_PRIORITY:
        index = SPEC_TYPE_PRIORITY.index(name)
        return (0 if index < _N_BUILTIN_DRAFTLESS else 2, index, name)
    return (3 if model_based else 1, 0, name)


def order_drafters(drafters: Iterable[Drafter]) -> list[Drafter]:
    return sorted(drafters, key=lambda d: priority_key(d.name, bool(getattr(d, "model_based", True))))


def load_drafter_class(name: str, extra: Mapping[str, DrafterSource] | None = None) -> DrafterSource:
    """The class (or directly registered instance) behind a spec-type name."""
    if extra and name in extra:
        return extra[name]
    eps = available_drafters()
    ep = eps.get(name)
    if ep is None:
        raise ConfigError(f"unknown spec type {name!r}; available: {_available_text(extra)}")
    try:
        cls = ep.load()
    except Exception as exc:  # a broken plugin must not take the whole engine down with a traceback
        raise ConfigError(
            f"drafter {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}; "
            f"available: {_available_text(extra)}"
        ) from None
    if not callable(getattr(cls, "create", None)):
        raise ConfigError(f"drafter {name!r} ({ep.value}) has no create(ctx) factory")
    return cls


def create_drafter(name: str, ctx: DrafterContext, extra: Mapping[str, DrafterSource] | None = None) -> Drafter:
    source = load_drafter_class(name, extra)
    if not isinstance(source, type):
        return source  # an instance registered directly
    try:
        drafter = source.create(ctx)
    except SpekulaError:
        raise
    except Exception as exc:
        raise ConfigError(f"drafter {name!r} could not be created: {type(exc).__name__}: {exc}") from None
    if not isinstance(drafter, Drafter):
        raise ConfigError(f"drafter {name!r}: create() returned {type(drafter).__name__}, not a Drafter")
    return drafter


def create_drafters(
    types: Iterable[str], ctx: DrafterContext, extra: Mapping[str, DrafterSource] | None = None
) -> list[Drafter]:
    """Create each named drafter once, in priority order (clear ConfigError on any failure)."""
    return order_drafters(create_drafter(name, ctx, extra) for name in dict.fromkeys(types))


def sources_by_name(drafters: Iterable[DrafterSource] | None) -> dict[str, DrafterSource]:
    """Index directly registered drafter classes/instances by their `name`."""
    out: dict[str, DrafterSource] = {}
    for source in drafters or ():
        name = getattr(source, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"drafter {source!r} has no `name`")
        out[name] = source
    return out
