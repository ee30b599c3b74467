"""Lazy public names for packages whose import must stay cheap (no torch, transformers or megatron).

Entry points import a plugin's package before its ``plugin`` module, and listing plugins must not import
torch, so each package exposes its public names through a module ``__getattr__`` built here (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``package.<exports[name]>`` on first access to ``name``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> submodule (relative to ``package``) that defines it.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(
                f"module {package!r} has no attribute {name!r}; it exports {sorted(exports)}"
            )
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
