"""What a Hugging Face safetensors directory holds: tensor names and shapes, from the file headers only.

Both backends read it before loading: FSDP checks every name and shape against the model its config
describes; Megatron asks whether a value model's checkpoint has a ``score`` head (a reward model or critic
starting from a language model has none: the head starts fresh, as ``from_pretrained`` starts it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint import HuggingFaceStorageReader

from ._errors import CheckpointError

SAFETENSORS = "*.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointIndex:
    """Names and full shapes of the tensors in a Hugging Face safetensors directory (read from file headers).

    Attributes:
        path: the directory.
        shapes: checkpoint name -> full shape.
    """

    path: Path
    shapes: Mapping[str, tuple[int, ...]]


def read_checkpoint_index(path: Path) -> CheckpointIndex:
    """The tensors of ``path``'s safetensors files, from their headers only (no tensor data is read).

    Raises:
        FileNotFoundError: ``path`` holds no ``*.safetensors`` file; the message lists what it does hold.
        CheckpointError: ``path`` has an index that does not list every safetensors file (a stale left-over
            that ``from_pretrained`` would skip but a directory-wide read would not).
    """
    files = sorted(file.name for file in path.glob(SAFETENSORS))
    if not files:
        found = sorted(entry.name for entry in path.iterdir())
        raise FileNotFoundError(
            f"model.path={str(path)!r} has a config.json but no *.safetensors weights (it holds {found}). "
            "Write the weights with save_pretrained(path, safe_serialization=True), set "
            "model.from_config_only=True to start from fresh weights, or set engine.meta_init=False to load "
            "other formats through from_pretrained (every rank then holds the whole model)."
        )
    if (path / INDEX).is_file():
        listed = set(json.loads((path / INDEX).read_text())["weight_map"].values())
        if unlisted := [name for name in files if name not in listed]:
            raise CheckpointError(
                f"{path} holds safetensors files that its {INDEX} does not list: {unlisted}. The sharded loader "
                "reads every *.safetensors file in the directory; move or delete the files the index does not "
                "name (from_pretrained ignores them)."
            )
    metadata = HuggingFaceStorageReader(str(path)).read_metadata()
    return CheckpointIndex(
        path=path,
        shapes={name: tuple(meta.size) for name, meta in metadata.state_dict_metadata.items()},  # type: ignore[union-attr]
    )
