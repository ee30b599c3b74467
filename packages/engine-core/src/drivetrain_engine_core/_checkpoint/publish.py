"""Publishing a finished step and pruning old ones, so that a kill or a power loss at any moment leaves the
last complete step loadable.

Publication: fsync every file -> write and fsync ``manifest.json`` -> (re-save) rename the old copy aside ->
rename the new step in -> fsync the root -> replace and fsync ``latest`` -> delete the aside copy. Pruning
renames a step to a ``.trash-`` name (so it stops being a step) before deleting its files, and never touches
the step just published. Each stage passes a named point (:mod:`.points`) where tests inject faults.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from .durable import fsync_dir, fsync_tree, write_durably
from .layout import (
    LATEST_FILE,
    TRASH_PREFIX,
    aside_step_dir,
    complete_steps,
    step_dir_name,
    step_entries,
)
from .manifest import MANIFEST_FILE, Manifest, write_manifest
from .points import reach

logger = logging.getLogger(__name__)


def publish_step(
    root: Path,
    temporary: Path,
    global_step: int,
    manifest: Manifest,
    files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Complete the finished temporary step with its manifest, rename it into place, point ``latest`` at it.

    Re-saving an existing step renames the old copy aside first and deletes it last, so some complete copy
    of the step exists at every moment.

    Args:
        files: the step's file descriptions, hashed by every rank (:mod:`.file_shares`); ``None`` hashes them
            here.

    Returns:
        The published step directory.
    """
    fsync_tree(temporary)
    reach("files_synced")
    write_manifest(temporary, manifest, files)
    fsync_dir(temporary)
    reach("manifest_written")
    final = root / step_dir_name(global_step)
    aside = _make_room(root, final, global_step)
    os.replace(temporary, final)
    fsync_dir(root)
    fsync_dir(root.parent)
    reach("step_renamed")
    write_durably(root / LATEST_FILE, final.name)
    fsync_dir(root)
    reach("latest_replaced")
    if aside is not None:
        discard(aside)
    return final


def _make_room(root: Path, final: Path, global_step: int) -> Path | None:
    """Move an existing copy of the step aside; returns the aside copy to delete once the new step is in."""
    aside = aside_step_dir(root, global_step)
    if _exists(aside) and _exists(final):
        # An earlier re-save of this step was interrupted: keep whichever copy is complete.
        discard(aside if (final / MANIFEST_FILE).is_file() else final)
    if _exists(final):
        os.replace(final, aside)
        fsync_dir(root)
        reach("old_step_aside")
    return aside if _exists(aside) else None


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def prune_old_steps(root: Path, keep: int | None, *, published: Path) -> list[Path]:
    """Delete complete steps beyond the newest ``keep`` (``None``: keep all), never ``published`` (the step
    this save wrote).

    ``published`` counts as one of the ``keep`` whatever its number, so a run that saves a lower step number
    than an older run left in the root never deletes its own step. What interrupted saves and prunes left is
    deleted too (:func:`_sweep`), whatever ``keep``.

    Returns:
        The steps deleted.
    """
    others = [path for _, path in complete_steps(root) if path != published]
    doomed = others[: max(len(others) - (keep - 1), 0)] if keep is not None and keep > 0 else []
    for path in doomed:
        discard(path)
    _sweep(root)
    return doomed


def discard(path: Path) -> None:
    """Invalidate a step by renaming it to a trash name (durably), then delete it; a symlink is unlinked."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name.lstrip('.')}-{uuid.uuid4().hex[:8]}"
    os.replace(path, trash)
    fsync_dir(path.parent)
    reach("step_invalidated")
    _delete(trash)


def _sweep(root: Path) -> None:
    """Delete what interrupted saves and prunes left: trash, aside copies whose step is complete again, and
    temporary steps (a save that died before publication; the step just published is no longer temporary).
    Left, a full-size temporary step stayed until the same step number was saved again, which a changed
    ``save_every`` or a crash on the last save never did."""
    for trash in root.glob(f"{TRASH_PREFIX}*"):
        _delete(trash)
    loadable = {path for _, path in complete_steps(root)}
    for entry in step_entries(root):
        if entry.kind == "temporary" or (entry.kind == "aside" and entry.path not in loadable):
            discard(entry.path)


def _delete(path: Path) -> None:
    """Delete an invalidated entry (trash, or a temporary step), best effort.

    NOTE: it is housekeeping after the save is published: a failure (NFS keeps ``.nfsXXXX`` files of a step
    still open elsewhere: "Directory not empty") raised on rank 0 alone, killed a run whose save had succeeded
    while the other ranks waited, and failed every later save at the same leftover. It is logged and retried
    at the next save; what stays cannot be loaded (it has no step name).
    """
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)
    except OSError as e:
        logger.warning(
            "could not delete %s (%s: %s); the next save tries again, or delete it by hand.",
            path,
            type(e).__name__,
            e,
        )
