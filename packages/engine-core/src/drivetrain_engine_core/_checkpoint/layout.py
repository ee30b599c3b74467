"""Directory layout of a checkpoint root: ``global_step_<N>/`` steps, a ``latest`` pointer, and how a root
resolves to the step to load.

Names under a root:

- ``global_step_<N>/``: a published step; complete when it holds ``manifest.json``.
- ``.tmp-global_step_<N>/``: a step being written; never loaded.
- ``.old-global_step_<N>/``: the previous copy of step ``N`` while a re-save of ``N`` is published (renamed
  aside, then deleted). A kill in between can leave it as the only complete copy: it is then loadable.
- ``.trash-*``: a pruned step, invalidated by the rename, being deleted.
- ``latest``: the name of the newest published step (a bare step name, never a path).

Publication and pruning live in :mod:`.publish`.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .._errors import CheckpointError
from .manifest import MANIFEST_FILE, read_manifest, verify_files

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
MODEL_DIR = "model"
"""The part of a step that holds the model state, in every backend's layout."""
OPTIMIZER_DIR = "optimizer"
"""The part of a step that holds the optimizer state, in every backend's layout (resuming needs it)."""
TEMPORARY_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
TRASH_PREFIX = ".trash-"
_STEP_PATTERN = re.compile(r"^global_step_(\d+)$")
_ENTRY_PATTERN = re.compile(r"^(\.tmp-|\.old-)?global_step_(\d+)$")
StepKind = Literal["step", "temporary", "aside"]


@dataclass(frozen=True)
class StepEntry:
    """One step-like directory of a root.

    Attributes:
        global_step: the step number in its name.
        path: the directory (a real directory, never a symlink).
        kind: ``step`` (published), ``temporary`` (being written) or ``aside`` (previous copy during a re-save).
        complete: whether it holds a manifest.
    """

    global_step: int
    path: Path
    kind: StepKind
    complete: bool


def step_dir_name(global_step: int) -> str:
    return f"global_step_{global_step}"


def temporary_step_dir(root: Path, global_step: int) -> Path:
    """Where a step is written before it is complete."""
    return root / f"{TEMPORARY_PREFIX}{step_dir_name(global_step)}"


def aside_step_dir(root: Path, global_step: int) -> Path:
    """Where the previous copy of a step waits while a re-save of the same step is published."""
    return root / f"{ASIDE_PREFIX}{step_dir_name(global_step)}"


def prepare_temporary_step_dir(temporary: Path) -> None:
    """Create an empty temporary step directory, removing what an interrupted save left there."""
    if temporary.is_symlink():
        temporary.unlink()
    elif temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir(parents=True)


def step_entries(root: Path) -> list[StepEntry]:
    """Every step-like real directory directly under ``root``, oldest first; symlinks are never listed.

    Only real directories count so that pruning never follows a link out of the root, and resolution never
    loads what a link points at.
    """
    entries = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _ENTRY_PATTERN.match(child.name)
        if match is None or child.is_symlink() or not child.is_dir():
            continue
        kind: StepKind = {None: "step", TEMPORARY_PREFIX: "temporary", ASIDE_PREFIX: "aside"}[match.group(1)]  # type: ignore[assignment]
        complete = (child / MANIFEST_FILE).is_file()
        entries.append(StepEntry(int(match.group(2)), child, kind, complete))
    return sorted(entries, key=lambda e: (e.global_step, e.kind != "step", e.path.name))


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """``(global_step, path)`` of every loadable step under ``root``, oldest first.

    A published step with a manifest; or, for a step number whose published directory is missing or
    incomplete, the complete copy a re-save left aside.
    """
    chosen: dict[int, Path] = {}
    for entry in step_entries(root):
        if entry.complete and entry.kind != "temporary":
            chosen.setdefault(entry.global_step, entry.path)  # published sorts before aside
    return sorted(chosen.items())


def read_latest(root: Path) -> tuple[str | None, str]:
    """The step name ``latest`` holds when it is a valid step name, else ``None``, with why not.

    Only a bare ``global_step_<N>`` name is accepted: a pointer such as ``../..`` or an absolute path would
    load a directory outside the root.
    """
    pointer = root / LATEST_FILE
    if pointer.is_symlink() or not pointer.is_file():
        return None, f"'{LATEST_FILE}' is missing"
    name = pointer.read_text(errors="replace").strip()
    if not _STEP_PATTERN.match(name):
        return None, f"'{LATEST_FILE}' holds {name[:80]!r}, which is not a step name such as 'global_step_12'"
    return name, ""


def resolve_step_dir(path: Path | str) -> Path:
    """A step directory from either the step itself or a checkpoint root.

    A root resolves to the step ``latest`` names. When ``latest`` is missing, invalid or names a step that is
    not complete (a save interrupted before the pointer moved, a lost file), the newest complete step whose
    files match its manifest (sizes) is used instead, and a warning says so.

    Raises:
        CheckpointError: nothing loadable is there; the message lists the complete steps that exist.
    """
    candidate = Path(path)
    if (candidate / MANIFEST_FILE).is_file():
        return candidate
    if _ENTRY_PATTERN.match(candidate.name):
        raise CheckpointError(
            f"{candidate / MANIFEST_FILE} does not exist: step {candidate} is incomplete (its save was interrupted)."
        )
    steps = complete_steps(candidate)
    name, problem = read_latest(candidate)
    published = {path.name: path for _, path in steps}
    if name is not None and name in published:
        return published[name]
    if name is not None:
        problem = f"'{LATEST_FILE}' names {name}, which is not a complete step"
    for global_step, step in reversed(steps):
        rejected = _size_problem(step)
        if rejected is None:
            _say_fallback(candidate, problem, step, global_step)
            return step
        logger.warning("checkpoint %s is not usable: %s", step, rejected)
    raise CheckpointError(
        f"no checkpoint to load at {candidate}: it is neither a step directory with {MANIFEST_FILE} nor a root "
        f"with a complete step ({problem}). Complete steps there: {[p.name for p in published.values()] or 'none'}."
    )


def _size_problem(step: Path) -> str | None:
    try:
        verify_files(step, read_manifest(step), checksums=False)
    except CheckpointError as e:
        return str(e)
    return None


def _say_fallback(root: Path, problem: str, step: Path, global_step: int) -> None:
    from .. import _distributed as distributed

    if distributed.rank() == 0:
        logger.warning(
            "checkpoint root %s: %s; using the newest complete step instead: %s (step %d).",
            root,
            problem,
            step.name,
            global_step,
        )
