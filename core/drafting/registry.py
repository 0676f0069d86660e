"""Drafter registry: llama.cpp's spec-type names mapped to classes through entry points.

Drafters are found only through the ``spekula.drafters`` entry-point group, so a third-party
distribution adds a technique by declaring an entry point; nothing in spekula names it. An engine
may also be handed drafter classes or instances directly (tests, benchmarks): those shadow entry
points of the same name.

Priority (docs/semantics.md §3): the user's order never matters. Built-in draftless types
come first in their fixed order, then third-party draftless types (by name), then the built-in
model types, then third-party model-based types (by name). Both the fixed order and the precedence
class come from the drafters themselves: ``description.builtin_order`` of spekula's own drafters
and every drafter's ``model_based`` flag.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from spekula.core.drafting.description import UNDESCRIBED, DrafterDescription
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.errors import ConfigError, SpekulaError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

ENTRY_POINT_GROUP = "spekula.drafters"
_OWN_PACKAGE = "spekula."  # entry points into spekula's own package are its built-in drafters

DrafterSource = type | Drafter  # a class with create(ctx), or a ready instance


def _search_path_state() -> tuple[tuple[str, int], ...]:
    """sys.path with each folder's mtime: installing or removing a distribution changes its folder's."""
    state = []
    for folder in sys.path:
        try:
            state.append((folder, os.stat(folder or ".").st_mtime_ns))
        except OSError:
            state.append((folder, -1))
    return tuple(state)


@cache
def _declared(state: tuple[tuple[str, int], ...]) -> tuple[EntryPoint, ...]:
    # Reading the group opens every installed distribution's metadata (thousands of files in a venv
    # with torch and ray); the CLI asks dozens of times while it builds its options. importlib.metadata
    # is imported here, not at the top: a command without speculation never reads the group.
    from importlib.metadata import entry_points

    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def available_drafters() -> dict[str, EntryPoint]:
    """Every drafter name declared in the entry-point group (first declaration of a name wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in _declared(_search_path_state()):
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
    chosen: dict[str, None] = {}
    for value in values:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        if "none" in names:
            continue
        known = set(available_drafters()) | set(extra or ())
        for name in names:
            if name not in known:
                raise ConfigError(f"unknown spec type {name!r}; available: {_available_text(extra)}")
            chosen[name] = None
    return tuple(sorted(chosen, key=lambda n: priority_key(n, False)))


@cache
def _entry_point_class(name: str, value: str) -> Any:
    """The object an entry point names, imported once (exceptions are not cached: each try reports)."""
    from importlib.metadata import EntryPoint

    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP).load()


def describe(source: Any) -> DrafterDescription:
    """What a drafter class (or instance) declares about itself; third-party drafters may declare nothing."""
    description = getattr(source, "description", None)
    return description if isinstance(description, DrafterDescription) else UNDESCRIBED


@dataclass(frozen=True, slots=True)
class DrafterEntry:
    """One installed drafter, loaded: what the CLI, the docs and the priority order read."""

    name: str
    source: Any  # the class (or a directly registered instance)
    description: DrafterDescription
    model_based: bool
    builtin: bool  # spekula's own, ranked by its description's builtin_order


def _entry(name: str, source: Any, builtin: bool) -> DrafterEntry:
    description = describe(source)
    return DrafterEntry(name, source, description, bool(getattr(source, "model_based", True)),
                        builtin and description.builtin_order is not None)


@cache
def _builtin_ranks(own: tuple[tuple[str, str], ...]) -> dict[str, tuple[bool, int]]:
    ranks: dict[str, tuple[bool, int]] = {}
    for name, value in own:
        entry = _entry(name, _entry_point_class(name, value), True)
        if entry.builtin and entry.description.builtin_order is not None:
            ranks[name] = (entry.model_based, entry.description.builtin_order)
    return ranks


def builtin_ranks() -> dict[str, tuple[bool, int]]:
    """spekula's own drafters: name -> (model_based, builtin_order)."""
    own = tuple(sorted((n, ep.value) for n, ep in available_drafters().items() if ep.value.startswith(_OWN_PACKAGE)))
    return _builtin_ranks(own)


def builtin_spec_types() -> tuple[str, ...]:
    """spekula's own drafter names in their fixed priority order (docs/semantics.md §3)."""
    ranks = builtin_ranks()
    return tuple(sorted(ranks, key=lambda n: priority_key(n, ranks[n][0])))


def drafter_entries(extra: Mapping[str, DrafterSource] | None = None) -> list[DrafterEntry]:
    """Every drafter that loads (entry points, and `extra` shadowing them), in priority order. A plugin
    that fails to import is left out here: it is reported, as a ConfigError, when it is asked for."""
    out: dict[str, DrafterEntry] = {}
    for name, ep in available_drafters().items():
        try:
            source = _entry_point_class(name, ep.value)
        except Exception:
            continue
        out[name] = _entry(name, source, ep.value.startswith(_OWN_PACKAGE))
    for name, source in (extra or {}).items():
        out[name] = _entry(name, source, False)
    return sorted(out.values(), key=lambda e: priority_key(e.name, e.model_based))


def priority_key(name: str, model_based: bool) -> tuple[int, int, str]:
    """Sort key placing `name` per docs/semantics.md §3: spekula's own drafters by their fixed order and
    their own precedence class, third-party names by `model_based`, then by name."""
    rank = builtin_ranks().get(name)
    if rank is not None:
        own_model_based, order = rank
        return (2 if own_model_based else 0, order, name)
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
        cls = _entry_point_class(name, ep.value)
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
