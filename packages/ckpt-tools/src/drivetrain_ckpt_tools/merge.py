"""``drivetrain ckpt merge``: one complete checkpoint step -> a Hugging Face model (or PEFT adapter) directory.

The step is verified against its manifest before anything is written; the output is built in a hidden
temporary directory beside the destination and renamed into place only when complete, so a failed merge
leaves nothing behind and an interrupted one never looks finished.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from drivetrain_engine_core.backend import CheckpointError, CheckpointMerger
from drivetrain_engine_core.job import (
    DrivetrainPlugins,
    fsync_dir,
    fsync_tree,
    resolve_step_dir,
    verify_files,
)
from drivetrain_engine_core.job import plugins as default_plugins
from drivetrain_engine_core.kit import read_manifest

from .hf_files import copy_side_files, write_model_config
from .lora import merged_base_tensors, write_adapter_dir
from .progress import base_tensor_count, merge_progress
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter

MERGE_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a merge may cast the weights to."""

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class MergeOptions:
    """How to merge.

    Attributes:
        merge_lora: for LoRA steps, fold the adapters into the base weights and write a full model instead
            of a PEFT adapter directory.
        overwrite: replace an existing destination.
        max_shard_bytes: safetensors shard size; a larger model gets several shards and an index.
        verify_checksums: check every file's SHA-256 against the manifest (sizes are always checked).
        dtype: cast the floating weights to ``float32``, ``bfloat16`` or ``float16``; ``None`` writes them as
            the checkpoint holds them (FSDP: the float32 master weights). ``config.json`` names the dtype
            written either way.
        model_path: the model the checkpoint starts from, when it is no longer where the manifest says (a
            checkpoint copied to another machine); ``None`` uses the manifest's ``model_path``.
    """

    merge_lora: bool = False
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    verify_checksums: bool = True
    dtype: str | None = None
    model_path: str | None = None

    def __post_init__(self) -> None:
        if self.max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {self.max_shard_bytes}.")
        if self.dtype is not None and self.dtype not in MERGE_DTYPES:
            raise ValueError(f"dtype must be one of {list(MERGE_DTYPES)} (or unset), got {self.dtype!r}.")


@dataclass(kw_only=True, frozen=True)
class MergeResult:
    """What a merge wrote.

    Attributes:
        step_dir: the checkpoint step that was merged.
        destination: the written directory.
        kind: ``model`` (a full Hugging Face model) or ``adapter`` (a PEFT adapter directory).
        files: names of the files in ``destination``.
    """

    step_dir: Path
    destination: Path
    kind: str
    files: list[str] = field(default_factory=list)


def open_merger(
    src: Path | str,
    *,
    verify_checksums: bool = True,
    model_path: str | None = None,
    plugins: DrivetrainPlugins | None = None,
):
    """Resolve ``src`` to a complete step, verify its files and build the merger of the backend that wrote it;
    ``model_path`` stands in for the manifest's source model (verl's ``--hf_model_path``).

    Raises:
        CheckpointError: no complete step, or a file is missing, truncated or corrupt (the message names it).
        PluginError: no merger is installed for the step's backend.
    """
    step_dir = resolve_step_dir(src)
    manifest = read_manifest(step_dir)
    verify_files(step_dir, manifest, checksums=verify_checksums)
    if model_path is not None:
        manifest = dataclasses.replace(manifest, model_path=str(Path(model_path).resolve()))
    merger_cls = (plugins or default_plugins()).mergers.get(manifest.backend)
    return merger_cls(step_dir, manifest)


def merge_checkpoint(
    src: Path | str,
    dst: Path | str,
    options: MergeOptions | None = None,
    *,
    plugins: DrivetrainPlugins | None = None,
    progress: bool = False,
) -> MergeResult:
    """Merge the checkpoint step at ``src`` (a step or a root with ``latest``) into ``dst``; ``progress`` shows
    the weights written on stderr when it is a terminal (:mod:`.progress`).

    Raises:
        CheckpointError: ``dst`` exists without ``overwrite``, ``dst`` contains or lies inside ``src``
            (replacing it would delete checkpoint data), or the step is incomplete or damaged.
    """
    options = options or MergeOptions()
    destination = Path(dst)
    _refuse_destination_holding(destination, Path(src), "the checkpoint")
    if destination.exists() and not options.overwrite:
        raise CheckpointError(
            f"destination {destination} already exists; choose another path or pass --overwrite to replace it."
        )
    merger = open_merger(
        src, verify_checksums=options.verify_checksums, model_path=options.model_path, plugins=plugins
    )
    _refuse_destination_holding(
        destination, Path(merger.manifest.model_path), "the model the checkpoint starts from"
    )
    destination.parent.mkdir(parents=True, exist_ok=True)
    _sweep_staging(destination)
    staging = destination.parent / f"{_STAGING_PREFIX.format(name=destination.name)}{os.getpid()}"
    staging.mkdir()
    try:
        kind = _write(merger, staging, options, progress=progress)
        fsync_tree(staging)
        _replace(staging, destination)
        fsync_dir(destination.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return MergeResult(
        step_dir=merger.step_dir, destination=destination, kind=kind, files=sorted(os.listdir(destination))
    )


def _refuse_destination_holding(destination: Path, source: Path, what: str) -> None:
    """A destination that is, contains or lies inside ``source`` (the checkpoint, or the model its steps need to
    be merged and loaded): ``--overwrite`` would delete it."""
    target, kept = destination.resolve(), source.resolve()
    if kept == target or target in kept.parents or kept in target.parents:
        raise CheckpointError(
            f"destination {destination} contains {what}, {source} (or lies inside it); writing there would "
            "delete it. Choose a destination outside it, e.g. a new directory beside the run."
        )


_STAGING_PREFIX = ".{name}.tmp-"
"""A merge is written into ``.<dst>.tmp-<pid>`` beside ``dst`` and renamed into place when complete."""


def _sweep_staging(destination: Path) -> None:
    """Remove staging directories of earlier merges into ``destination`` whose process is gone (a killed merge
    left a full-size hidden copy, and the next one used another pid)."""
    prefix = _STAGING_PREFIX.format(name=destination.name)
    for leftover in destination.parent.glob(f"{glob.escape(prefix)}*"):
        pid = leftover.name.removeprefix(prefix)
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _write(merger: CheckpointMerger, directory: Path, options: MergeOptions, *, progress: bool) -> str:
    """Fill ``directory``; returns ``model`` or ``adapter``."""
    if not Path(merger.manifest.model_path).is_dir():
        # An adapter needs no base weights to be written, but its tokenizer files come from there.
        logger.warning(
            "%s, the model this checkpoint starts from, is not there: the output has no tokenizer files and "
            "names that path as its base model. Pass --model-path with a copy of it.",
            merger.manifest.model_path,
        )
    copy_side_files(merger.manifest.model_path, directory)
    if merger.is_lora and not options.merge_lora:
        if options.dtype is not None or options.max_shard_bytes != DEFAULT_MAX_SHARD_BYTES:
            logger.warning(
                "--dtype and --max-shard-size apply to full models: the adapter is written as trained, in one "
                "file (add --merge-lora for a full model)"
            )
        write_adapter_dir(merger, directory)
        return "adapter"
    tensors = merged_base_tensors(merger) if merger.is_lora else merger.base_tensors()
    writer = ShardedSafetensorsWriter(directory, max_shard_bytes=options.max_shard_bytes)
    skipped = _tied_names(merger)
    cast = None if options.dtype is None else getattr(torch, options.dtype)
    elements: Counter[torch.dtype] = Counter()
    with merge_progress(base_tensor_count(merger), enabled=progress) as bar:
        for name, tensor in tensors:
            bar.update(1)
            if name in skipped:
                continue
            if tensor.is_floating_point():
                tensor = tensor if cast is None else tensor.to(cast)
                elements[tensor.dtype] += tensor.numel()
            writer.add(name, tensor)
    writer.close()
    # NOTE: the config names the dtype of most weights, as save_pretrained names the model's: FSDP merges
    # wrote float32 weights under the source's bfloat16, so a loader's dtype="auto" silently rounded them.
    write_model_config(merger, directory, elements.most_common(1)[0][0] if elements else torch.float32)
    return "model"


def _tied_names(merger: CheckpointMerger) -> set[str]:
    """Weights transformers re-ties on load and ``save_pretrained`` leaves out (a tied output embedding)."""
    config = merger.source_config()
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    return {"lm_head.weight"} if tied and merger.manifest.model_type == "language_model" else set()


def _replace(staging: Path, destination: Path) -> None:
    """Move the finished output into place; an old destination is removed only once the new one is ready."""
    if destination.exists():
        retired = destination.parent / f".{destination.name}.old-{os.getpid()}"
        os.replace(destination, retired)
        os.replace(staging, destination)
        shutil.rmtree(retired)
    else:
        os.replace(staging, destination)


__all__ = ["MergeOptions", "MergeResult", "merge_checkpoint", "open_merger"]
