"""Directory layout of a checkpoint root: ``global_step_<N>/`` steps, a ``latest`` pointer, atomic publication.

A step is written under a hidden temporary name and renamed once its manifest exists, so a crash never
leaves a directory that looks complete; ``latest`` is replaced with ``os.replace``; old steps are deleted
only after the new one is published.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import CheckpointError
from .manifest import MANIFEST_FILE

LATEST_FILE = "latest"
_STEP_PATTERN = re.compile(r"^global_step_(\d+)$")


def step_dir_name(global_step: int) -> str:
    return f"global_step_{global_step}"


def temporary_step_dir(root: Path, global_step: int) -> Path:
    """Where a step is written before it is complete."""
    return root / f".tmp-{step_dir_name(global_step)}"


def prepare_temporary_step_dir(temporary: Path) -> None:
    """Create an empty temporary step directory, removing what an interrupted save left there."""
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir(parents=True)


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """``(global_step, path)`` of every step directory under ``root`` that has a manifest, oldest first."""
    steps = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _STEP_PATTERN.match(child.name)
        if match and (child / MANIFEST_FILE).is_file():
            steps.append((int(match.group(1)), child))
    return sorted(steps)


def publish_step(root: Path, temporary: Path, global_step: int) -> Path:
    """Rename a finished temporary step into place and point ``latest`` at it."""
    final = root / step_dir_name(global_step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    pointer = root / f".{LATEST_FILE}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST_FILE)
    return final


def prune_old_steps(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete steps; returns what was deleted."""
    doomed = [path for _, path in complete_steps(root)[:-keep]] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def resolve_step_dir(path: Path | str) -> Path:
    """A step directory from either the step itself or a checkpoint root (through ``latest``).

    Raises:
        CheckpointError: nothing loadable is there; the message lists the complete steps that exist.
    """
    candidate = Path(path)
    if (candidate / MANIFEST_FILE).is_file():
        return candidate
    pointer = candidate / LATEST_FILE
    if pointer.is_file():
        step = candidate / pointer.read_text().strip()
        if (step / MANIFEST_FILE).is_file():
            return step
    if _STEP_PATTERN.match(candidate.name):
        raise CheckpointError(
            f"{candidate / MANIFEST_FILE} does not exist: step {candidate} is incomplete (its save was interrupted)."
        )
    found = [p.name for _, p in complete_steps(candidate)]
    raise CheckpointError(
        f"no checkpoint to load at {candidate}: it is neither a step directory with {MANIFEST_FILE} nor a root with "
        f"a valid '{LATEST_FILE}' pointer. Complete steps there: {found or 'none'}."
    )
