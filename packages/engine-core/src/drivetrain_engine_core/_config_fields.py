"""What a config dataclass declares about its fields: resolved types, nested dataclasses and help text.

Annotations are strings (``from __future__ import annotations``), so they are resolved against the module
that declares each class; the help text is the ``Attributes:`` section of the Google-style class docstrings
(subclasses inherit their bases' entries), so ``--help-config`` and the reference page say what the code does.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from typing import Any

_ENTRY = re.compile(r"^(?P<names>[A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:\s*(?P<text>.*)$")


def field_types(cls: type) -> dict[str, Any]:
    """Each field's resolved annotation (an unresolvable one, imported only for type checkers, is ``Any``)."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError:
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def nested_dataclass(annotation: Any) -> type | None:
    """The dataclass an annotation holds (``X`` or ``X | None``), else ``None``."""
    candidates = typing.get_args(annotation) or (annotation,)
    return next((c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def type_name(annotation: Any) -> str:
    """``int``, ``int | None``, ``tuple[str, ...]``, ``'a' | 'b'``: how a field's type is shown to users."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def how_to_write(annotation: Any, name: str) -> str:
    """How to write a value of ``annotation``'s type for the field ``name`` (the end of a type error)."""
    shown = type_name(annotation)
    if shown.endswith(" | None"):
        return f"{_hint(shown.removesuffix(' | None'), name).removesuffix('.')}, or null to unset it."
    return _hint(shown, name)


def _hint(shown: str, name: str) -> str:
    """How to write a value of the type named ``shown`` for the field ``name``."""
    if shown.startswith("bool"):
        return f"write true or false, e.g. {name}=false."
    if shown.startswith("tuple[") and "..." not in shown:
        count = len(shown.removeprefix("tuple[").removesuffix("]").split(", "))
        example = ", ".join("abcdefgh"[:count])
        return f"write a list of exactly {count} values in brackets, e.g. {name}=[{example}]."
    if shown.startswith(("tuple", "list")):
        return f"write a list in brackets, e.g. {name}=[a, b] (one item: {name}=[a])."
    if shown.startswith("int"):
        return f"write a whole number, e.g. {name}=100."
    if shown.startswith("float"):
        return f"write a number, e.g. {name}=0.5."
    return f"write a value of type {shown}."


def field_docs(cls: type) -> dict[str, str]:
    """Help text of each field, read from the ``Attributes:`` sections of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_attribute_entries(inspect.getdoc(klass) or "") if klass.__doc__ else {})
    return docs


def _attribute_entries(docstring: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    lines = docstring.splitlines()
    if "Attributes:" not in lines:
        return entries
    names: list[str] = []
    for line in lines[lines.index("Attributes:") + 1 :]:
        if line and not line.startswith(" "):
            break
        match = _ENTRY.match(line[4:]) if line.startswith("    ") and not line.startswith("     ") else None
        if match:
            names = [n.strip() for n in match["names"].split(",")]
            for name in names:
                entries[name] = match["text"].strip()
        elif line.strip() and names:
            for name in names:
                entries[name] += " " + line.strip()
    return entries


__all__ = ["field_docs", "field_types", "how_to_write", "nested_dataclass", "type_name"]
