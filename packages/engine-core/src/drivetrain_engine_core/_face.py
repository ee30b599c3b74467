"""How a face module names what it offers once: its ``if TYPE_CHECKING:`` imports are the list.

A face (``backend``, ``kit``, ``rollout``, ``job``) is the page a plugin author reads. Its type-checking block
names each public name once, with the private module that defines it; type checkers and the API check read that
block, and at run time :func:`face` turns it into ``__all__`` and a module ``__getattr__`` that imports the
defining module on first use (PEP 562), so that a plugin module importing ``hookimpl`` does not load torch.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(source: str) -> Iterator[tuple[str, str, str]]:
    """``(public name, relative module, name in that module)`` of each import under ``if TYPE_CHECKING:``."""
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and _is_type_checking(node.test)):
            continue
        for statement in node.body:
            if isinstance(statement, ast.ImportFrom):
                module = "." * statement.level + (statement.module or "")
                for alias in statement.names:
                    yield alias.asname or alias.name, module, alias.name


def face(module_name: str) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and ``__getattr__`` of the face ``module_name``, read from its type-checking imports."""
    module = sys.modules[module_name]
    source = Path(module.__file__ or "").read_text(encoding="utf-8")
    table = {public: (relative, name) for public, relative, name in _imports(source)}

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(
                f"module {module_name!r} has no attribute {name!r}; it offers {sorted(table)}"
            )
        relative, inner = table[name]
        owner = importlib.import_module(relative, module.__package__)
        if not hasattr(owner, inner):  # ``from . import _module as name``: a submodule not yet imported
            return importlib.import_module(f"{owner.__name__}.{inner}")
        return getattr(owner, inner)

    return sorted(table), __getattr__
