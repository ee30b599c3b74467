"""``drivetrain ckpt ls``: what a checkpoint root holds, step by step, without reading any tensor."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from drivetrain_engine_core.checkpoint import LATEST_FILE, MANIFEST_FILE, read_manifest, verify_files
from drivetrain_engine_core.errors import CheckpointError

_STEP_DIR = re.compile(r"^(?:\.tmp-)?global_step_(\d+)$")


@dataclass(kw_only=True, frozen=True)
class StepInfo:
    """One step directory of a checkpoint root.

    Attributes:
        global_step: the step number.
        path: the step directory.
        complete: whether its manifest exists (a step without one was interrupted and cannot be merged).
        latest: whether ``latest`` points at it.
        backend, world_size, model_type, lora: from the manifest (``None`` for incomplete steps).
        contents: top-level entries of the step (``model``, ``optimizer``, ``extra``, ...).
        size_bytes: total size of the step's files.
        problem: why the step cannot be used (missing manifest, or a damaged file when checked), else ``None``.
    """

    global_step: int
    path: str
    complete: bool
    latest: bool = False
    backend: str | None = None
    world_size: int | None = None
    model_type: str | None = None
    lora: dict[str, Any] | None = None
    contents: list[str] = field(default_factory=list)
    size_bytes: int = 0
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_steps(root: Path | str, *, check_files: bool = False) -> list[StepInfo]:
    """Describe every step directory under ``root`` (complete or not), oldest first.

    Args:
        root: a checkpoint root.
        check_files: also verify every file's size and SHA-256 against the manifest.

    Raises:
        CheckpointError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} is not a directory.")
    pointer = root / LATEST_FILE
    latest = pointer.read_text().strip() if pointer.is_file() else None
    steps = []
    for child in sorted(root.iterdir()):
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            steps.append(_describe(child, int(match.group(1)), child.name == latest, check_files))
    return sorted(steps, key=lambda step: (step.global_step, step.path))


def _describe(step_dir: Path, global_step: int, latest: bool, check_files: bool) -> StepInfo:
    base = StepInfo(
        global_step=global_step,
        path=str(step_dir),
        complete=False,
        latest=latest,
        contents=sorted(p.name for p in step_dir.iterdir()),
        size_bytes=sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()),
    )
    if not (step_dir / MANIFEST_FILE).is_file():
        return replace(base, problem=f"no {MANIFEST_FILE}: the save was interrupted")
    try:
        manifest = read_manifest(step_dir)
        if check_files:
            verify_files(step_dir, manifest)
    except CheckpointError as e:
        return replace(base, problem=str(e))
    return replace(
        base,
        complete=True,
        backend=manifest.backend,
        world_size=manifest.world_size,
        model_type=manifest.model_type,
        lora=manifest.lora,
    )


def format_steps(steps: list[StepInfo]) -> str:
    """A plain-text table of ``steps`` for the terminal."""
    if not steps:
        return "no checkpoint steps found"
    lines = [
        f"{'step':>8}  {'status':<10} {'backend':<9} {'world':>5}  {'model':<15} {'lora':<5} {'MB':>9}  contents"
    ]
    for step in steps:
        status = ("complete" if step.complete else "BROKEN") + ("*" if step.latest else "")
        lines.append(
            f"{step.global_step:>8}  {status:<10} {step.backend or '-':<9} {step.world_size or '-':>5}  "
            f"{step.model_type or '-':<15} {'yes' if step.lora else 'no':<5} {step.size_bytes / 1e6:>9.2f}  "
            f"{','.join(step.contents)}" + (f"\n          problem: {step.problem}" if step.problem else "")
        )
    lines.append("(* = latest)")
    return "\n".join(lines)


__all__ = ["StepInfo", "format_steps", "list_steps"]
