"""How checkpoint loading finds another backend's checkpoint merger: a slot the plugin registry fills.

The registry sits above the engine, which sits above the checkpoint code, so the lookup is handed down rather
than imported. It lives outside the ``checkpoint`` package so that the registry can fill it without importing
that package (and torch with it): ``drivetrain plugins`` and ``drivetrain engines`` never load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._checkpoint.merger import CheckpointMerger

MergerLookup = Callable[[str], "type[CheckpointMerger]"]
_lookup: list[MergerLookup] = []


def use_merger_lookup(lookup: MergerLookup) -> None:
    """Set how a step of another backend finds that backend's merger (the plugin registry sets it)."""
    _lookup[:] = [lookup]


def merger_lookup() -> MergerLookup | None:
    """The lookup :func:`use_merger_lookup` set, or ``None`` where no plugin registry was loaded."""
    return _lookup[0] if _lookup else None
