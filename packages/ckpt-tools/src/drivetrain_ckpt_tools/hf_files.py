"""The non-weight files of a merged Hugging Face directory: config, tokenizer, generation config.

The config is re-written for the merged model's head (a value model becomes a token-classification model
with one label); every other small file of the source model directory (tokenizer files, chat template,
generation config) is copied as is, so the merged directory loads and tokenizes exactly like the source.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from drivetrain_engine_core.checkpoint import CheckpointMerger
from drivetrain_engine_core.errors import CheckpointError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = {"config.json", "adapter_config.json"}


def write_model_config(merger: CheckpointMerger, directory: Path) -> None:
    """Write ``config.json`` for the merged model: the source config with the merged model's architecture.

    Raises:
        CheckpointError: the source config cannot be loaded by transformers.
    """
    from transformers import AutoConfig

    source = Path(merger.manifest.model_path)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot load the config of {source}, the model this checkpoint was trained from (manifest "
            "model_path); restore that directory."
        ) from e
    config.architectures = [merger.architecture]
    if merger.manifest.model_type == "value_model":
        # verl's critic convention: one score per token.
        config.num_labels = 1
    config.save_pretrained(directory)


def copy_side_files(source: Path | str, directory: Path) -> list[str]:
    """Copy the tokenizer, chat template and generation config (every small non-weight file) of ``source``.

    Returns:
        The names of the copied files.
    """
    copied = []
    for path in sorted(Path(source).iterdir()):
        if path.is_file() and path.name not in _NOT_COPIED and not _is_weight_file(path.name):
            shutil.copy2(path, directory / path.name)
            copied.append(path.name)
    return copied


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


__all__ = ["copy_side_files", "write_model_config"]
