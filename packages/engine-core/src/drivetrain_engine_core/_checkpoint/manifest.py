"""``manifest.json``: written last into a step directory, it is what makes a step complete.

It records which backend and world size wrote the step, what model it holds, and the size and SHA-256 of
every file, so that a missing or truncated shard is found before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from .durable import write_durably

MANIFEST_FILE = "manifest.json"
FORMAT = "drivetrain-checkpoint/1"
_HASH_CHUNK = 1 << 20


@dataclass(kw_only=True, frozen=True)
class Manifest:
    """Everything a reader needs to know about a step before opening its shards.

    Attributes:
        backend: engine backend that wrote the step (selects the merger).
        global_step: training step the state belongs to.
        world_size: number of ranks that wrote it.
        model_type: ``language_model`` or ``value_model``.
        model_path: the Hugging Face directory the model was built from (config, tokenizer).
        lora: the LoRA config as a dict, or ``None``.
        trust_remote_code: whether the model needs its own code to load (``model.trust_remote_code``): a merge
            and ``verify`` pass it to transformers (``False`` in manifests written before it was recorded).
        backend_info: backend layout details (parallel sizes, state-dict format).
        files: relative path -> ``{"size": int, "sha256": str}`` for every file of the step.
    """

    backend: str
    global_step: int
    world_size: int
    model_type: str
    model_path: str
    lora: dict[str, Any] | None = None
    trust_remote_code: bool = False
    backend_info: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    format: str = FORMAT

    @property
    def layout(self) -> dict[str, Any]:
        """The parallel layout the step was written with: the world size and the backend's ``*_size`` settings
        (and whether megatron's optimizer state is distributed), as ``drivetrain ckpt ls`` shows them."""
        sizes = {
            key: value
            for key, value in sorted(self.backend_info.items())
            if (key.endswith("_size") and key != "padded_vocab_size" and key != "vocab_size")
            or key == "use_distributed_optimizer"
        }
        return {"world_size": self.world_size, **{k: v for k, v in sizes.items() if v is not None}}


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in chunks so that large shards never sit in memory whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def step_files(step_dir: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``step_dir`` except the manifest itself, in path order."""
    sizes = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(step_dir).as_posix()
        if relative != MANIFEST_FILE:
            sizes[relative] = path.stat().st_size
    return sizes


def describe_files(step_dir: Path, relatives: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """Size and digest of the files ``relatives`` names under ``step_dir`` (default: all but the manifest)."""
    names = step_files(step_dir) if relatives is None else relatives
    return {
        relative: {"size": (step_dir / relative).stat().st_size, "sha256": file_digest(step_dir / relative)}
        for relative in names
    }


def write_manifest(
    step_dir: Path, manifest: Manifest, files: dict[str, dict[str, Any]] | None = None
) -> Manifest:
    """Write ``manifest`` with the step's file descriptions (``files``, or described here) atomically and
    fsynced; returns what was written."""
    complete = dataclasses.replace(manifest, files=describe_files(step_dir) if files is None else files)
    write_durably(
        step_dir / MANIFEST_FILE, json.dumps(dataclasses.asdict(complete), indent=2, sort_keys=True)
    )
    return complete


def read_manifest(step_dir: Path | str) -> Manifest:
    """Read a step's manifest.

    Raises:
        CheckpointError: the manifest is missing (an incomplete step) or unreadable.
    """
    path = Path(step_dir) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: {step_dir} is not a complete checkpoint step (a save was interrupted, "
            "or the path is not a step directory). Pick a step listed by `drivetrain ckpt ls ROOT`."
        )
    try:
        values = json.loads(path.read_text())
        return Manifest(**values)
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid drivetrain manifest: {e}") from e


def verify_files(
    step_dir: Path | str, manifest: Manifest, *, checksums: bool = True, only: Collection[str] | None = None
) -> None:
    """Check that every file the manifest lists (or those of them ``only`` names) exists with its size (and digest).

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    root = Path(step_dir)
    for relative, expected in sorted(manifest.files.items()):
        if only is not None and relative not in only:
            continue
        path = root / relative
        if not path.is_file():
            raise _damaged(root, f"checkpoint file {path} is missing (listed in {root / MANIFEST_FILE}).")
        size = path.stat().st_size
        if size != expected["size"]:
            raise _damaged(
                root,
                f"checkpoint file {path} has {size} bytes, the manifest says {expected['size']}: it is "
                "truncated or was rewritten.",
            )
        if checksums and file_digest(path) != expected["sha256"]:
            raise _damaged(
                root, f"checkpoint file {path} does not match its SHA-256 in the manifest: it is corrupt."
            )


def _damaged(step_dir: Path, problem: str) -> CheckpointError:
    """The error for a damaged step: the problem, and how to go on from another step."""
    return CheckpointError(
        f"{problem} Use another step: `drivetrain ckpt ls {step_dir.parent} --check` lists the intact ones, and "
        f"once {step_dir} is deleted, --resume continues from the newest remaining one."
    )
