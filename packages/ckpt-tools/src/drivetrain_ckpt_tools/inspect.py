"""``drivetrain ckpt ls``: what a checkpoint root holds, step by step, without reading any tensor."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import CheckpointError, PluginError
from drivetrain_engine_core.job import (
    MANIFEST_FILE,
    Manifest,
    StepEntry,
    complete_steps,
    plugins,
    read_latest,
    step_entries,
    verify_files,
)
from drivetrain_engine_core.kit import read_manifest


@dataclass(kw_only=True, frozen=True)
class StepInfo:
    """One step directory of a checkpoint root.

    Attributes:
        global_step: the step number.
        path: the step directory.
        complete: whether it is a loadable step: a published step with its manifest, or the complete copy an
            interrupted re-save left aside (``kind="aside"``) while the published copy is missing or incomplete.
        latest: whether ``latest`` points at it.
        kind: ``step`` (published), ``temporary`` (being written, never loaded) or ``aside`` (the previous copy
            of a step during a re-save).
        backend, world_size, model_type, lora: from the manifest (``None`` for incomplete steps).
        layout: the parallel layout that wrote the step (``Manifest.layout``: world size, the backend's
            ``*_size`` settings); another backend or layout can resume it (ARCHITECTURE §5).
        optimizer: how the step stores its optimizer state, as the backend's merger says (``per-parameter``;
            Megatron's ``distributed``: flat per-bucket buffers), ``None`` without one or without the merger.
        optimizer_moves: whether that state can resume on another backend or layout (a distributed-optimizer
            step needs the layout record its save writes); ``None`` when the backend's merger is not installed.
        contents: top-level entries of the step (``model``, ``optimizer``, ``extra``, ...).
        size_bytes: total size of the step's files.
        problem: why the step cannot be used (missing manifest, or a damaged file when checked), else ``None``.
        damaged: whether a published step failed the file check (``check_files``): a missing, truncated or
            altered file, which ``problem`` names. Interrupted saves are not damaged: a running job leaves them.
    """

    global_step: int
    path: str
    complete: bool
    latest: bool = False
    kind: str = "step"
    backend: str | None = None
    world_size: int | None = None
    model_type: str | None = None
    lora: dict[str, Any] | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    optimizer: str | None = None
    optimizer_moves: bool | None = None
    contents: list[str] = field(default_factory=list)
    size_bytes: int = 0
    problem: str | None = None
    damaged: bool = False

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
    latest, _ = read_latest(root)
    loadable = {path for _, path in complete_steps(root)}
    described = []
    for entry in step_entries(root):
        try:
            described.append(_describe(entry, entry.path.name == latest, entry.path in loadable, check_files))
        except FileNotFoundError:
            # NOTE: a running job renamed or pruned the step while it was read (publish renames `.tmp-` steps
            # into place, pruning moves old ones to `.trash-`): it is no longer there to describe.
            continue
    return described


def _describe(entry: StepEntry, latest: bool, loadable: bool, check_files: bool) -> StepInfo:
    step_dir = entry.path
    base = StepInfo(
        global_step=entry.global_step,
        path=str(step_dir),
        complete=False,
        latest=latest,
        kind=entry.kind,
        contents=sorted(p.name for p in step_dir.iterdir()),
        size_bytes=sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()),
    )
    if not entry.complete:
        return replace(base, problem=f"no {MANIFEST_FILE}: the save was interrupted")
    if not loadable:
        why = "never published (the save was interrupted before the rename)"
        if entry.kind == "aside":
            why = "superseded copy left by an interrupted re-save; the published step replaces it"
        return replace(base, problem=why)
    try:
        manifest = read_manifest(step_dir)
        if check_files:
            verify_files(step_dir, manifest)
    except CheckpointError as e:
        return replace(base, problem=str(e), damaged=check_files)
    optimizer, moves = _optimizer(step_dir, manifest)
    return replace(
        base,
        optimizer=optimizer,
        optimizer_moves=moves,
        complete=True,
        backend=manifest.backend,
        world_size=manifest.world_size,
        model_type=manifest.model_type,
        lora=manifest.lora,
        layout=manifest.layout,
    )


def _optimizer(step_dir: Path, manifest: Manifest) -> tuple[str | None, bool | None]:
    """The step's optimizer kind and whether it moves, as the merger of the backend that wrote it says (only the
    backend knows its optimizer format); unknown when that merger is not installed."""
    try:
        merger = plugins().mergers.get(manifest.backend)(step_dir, manifest)
    except PluginError:
        return None, None
    return merger.optimizer_kind(), merger.optimizer_moves()


def format_steps(steps: list[StepInfo]) -> str:
    """A plain-text table of ``steps`` for the terminal."""
    if not steps:
        return "no checkpoint steps found"
    lines = [
        f"{'step':>8}  {'status':<10} {'backend':<9} {'world':>5}  {'model':<15} {'lora':<5} {'MB':>9}  contents"
    ]
    for step in steps:
        status = ("complete" if step.complete else "BROKEN") + ("*" if step.latest else "")
        if step.complete and step.kind == "aside":
            status = "aside"
        lines.append(
            f"{step.global_step:>8}  {status:<10} {step.backend or '-':<9} {step.world_size or '-':>5}  "
            f"{step.model_type or '-':<15} {'yes' if step.lora else 'no':<5} {step.size_bytes / 1e6:>9.2f}  "
            f"{','.join(step.contents)}"
            + (f"\n          layout: {_layout(step.layout)}" if step.layout else "")
            + (f"\n          optimizer: {_optimizer_line(step)}" if step.complete else "")
            + (f"\n          problem: {step.problem}" if step.problem else "")
        )
    lines.append("(* = latest; aside = the only complete copy of a step whose re-save was interrupted)")
    return "\n".join(lines)


def _optimizer_line(step: StepInfo) -> str:
    if step.optimizer_moves is None:
        return "unknown (the backend's checkpoint merger is not installed)"
    if step.optimizer is None:
        return "none saved"
    moves = "yes" if step.optimizer_moves else "no (no layout record: resume with the layout that wrote it)"
    return f"{step.optimizer}, moves to other backends and layouts: {moves}"


def _layout(layout: dict[str, Any]) -> str:
    return " ".join(f"{key.removesuffix('_size')}={value}" for key, value in layout.items())


__all__ = ["StepInfo", "format_steps", "list_steps"]
