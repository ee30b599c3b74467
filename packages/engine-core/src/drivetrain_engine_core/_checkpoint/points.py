"""Named points of the checkpoint publish and prune sequences, where tests inject faults.

Production code passes each point through :func:`reach`; with no hook installed that is a no-op. A test
installs a hook with :func:`set_fault_hook` that raises or calls ``os._exit`` at one named point, which kills a
save exactly there instead of at a moment a sleep happens to pick.
"""

from __future__ import annotations

from collections.abc import Callable

PUBLISH_POINTS: tuple[str, ...] = (
    "files_synced",  # every file of the temporary step is on disk, no manifest yet
    "manifest_written",  # the temporary step is complete, not yet renamed
    "old_step_aside",  # re-save: the previous copy of this step was renamed aside
    "step_renamed",  # the new step is in place, `latest` still names the previous step
    "latest_replaced",  # `latest` names the new step, the aside copy (if any) not yet deleted
    "step_invalidated",  # pruning: an old step was renamed to a trash name, not yet deleted
)
"""Every point, in the order a save reaches them (``old_step_aside`` only when the step already exists)."""

_hook: Callable[[str], None] | None = None


def set_fault_hook(hook: Callable[[str], None] | None) -> None:
    """Install ``hook(point)`` to be called at every named point (``None`` removes it)."""
    global _hook
    _hook = hook


def reach(point: str) -> None:
    """Mark that the sequence reached ``point``; calls the installed hook, if any."""
    if point not in PUBLISH_POINTS:
        raise ValueError(f"unknown checkpoint point {point!r}; known points: {list(PUBLISH_POINTS)}.")
    if _hook is not None:
        _hook(point)
