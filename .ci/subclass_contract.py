"""Breaking changes for the code that subclasses an API class, which griffe's check does not see.

griffe judges an API from its callers' side and skips ``_`` names; a backend implements ``Engine``'s abstract
``_`` hooks and the base class calls them, so there the direction is reversed: a new abstract method, or any
change to a hook's parameters (even one with a default, which the base will pass), breaks every subclass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import griffe

Lookup = Callable[[str], "griffe.Object | griffe.Alias | None"]


def _is_abstract(obj: griffe.Object | griffe.Alias) -> bool:
    return obj.is_function and "abstractmethod" in obj.labels


def _parameters(hook: griffe.Object | griffe.Alias) -> tuple[tuple[str, str, str | None], ...] | str:
    """What a subclass must accept: each parameter's name, kind and default (annotations left out); a property
    or attribute has no parameters, only its kind."""
    if not hook.is_function:
        return hook.kind.value
    return tuple(
        (p.name, p.kind.value, None if p.default is None else str(p.default)) for p in hook.parameters
    )


def _signature(hook: griffe.Object | griffe.Alias) -> str:
    """:func:`_parameters` written as Python would, for the message."""
    parameters = _parameters(hook)
    if isinstance(parameters, str):
        return f"<{parameters}>"
    parts: list[str] = []
    for name, kind, default in parameters:
        if kind == "keyword-only" and not any(part.startswith("*") for part in parts):
            parts.append("*")
        prefix = {"variadic positional": "*", "variadic keyword": "**"}.get(kind, "")
        parts.append(f"{prefix}{name}" + ("" if default is None else f"={default}"))
    return "(" + ", ".join(parts) + ")"


def _abstract(cls: griffe.Object | griffe.Alias) -> set[str]:
    """Abstract methods, inherited ones included (a hook that moved to a base class is still a hook)."""
    return {name for name, member in cls.all_members.items() if _is_abstract(member)}


def _changed(
    path: str, before: griffe.Object | griffe.Alias, after: griffe.Object | griffe.Alias | None
) -> list[str]:
    if after is None:
        return [f"{path}: hook was removed (subclasses' overrides go unused)"]
    if _parameters(before) != _parameters(after):
        return [f"{path}: hook parameters changed: {_signature(before)} -> {_signature(after)}"]
    return []


def hook_breaks(entries: Iterable[str], old: Lookup, new: Lookup) -> list[str]:
    """One line per change to the hooks ``entries`` name, between the ``old`` and ``new`` trees.

    Args:
        entries: dotted paths of classes (their abstract methods are hooks) and of single methods subclasses
            override.
        old, new: look a dotted path up in the released and the current tree (None when absent).
    """
    lines = []
    for entry in entries:
        before, after = old(entry), new(entry)
        if before is None:
            continue  # new with this release: nothing to break
        if not before.is_class:
            lines += _changed(entry, before, after)
            continue
        if after is None:
            lines.append(f"{entry}: class was removed")
            continue
        for name in sorted(_abstract(before)):
            lines += _changed(f"{entry}.{name}", before.all_members[name], after.all_members.get(name))
        for name in sorted(_abstract(after) - _abstract(before)):
            lines.append(f"{entry}.{name}: abstract method was added (every subclass must implement it)")
    return lines
