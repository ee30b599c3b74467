"""The non-weight files of a merged Hugging Face directory: config, tokenizer, generation config.

The config is the source's ``config.json`` edited as JSON for the merged model: its head (a value model
becomes a token-classification model with one label) and the dtype of the weights written. Editing the file
rather than re-saving a loaded ``AutoConfig`` keeps the source's format: transformers 5 re-saves a config in
its own layout (``rope_theta`` moved into ``rope_parameters``, ``torch_dtype`` renamed ``dtype``), which
transformers 4 (pinned by many vLLM/SGLang/verl environments) reads as the default RoPE base. The tokenizer
files, chat template and generation config of the source model directory are copied as is, so the merged
directory loads and tokenizes exactly like the source. Only those named files are copied (an allow-list),
only regular files, and only up to a size cap: a merge must not carry whatever else sits in the source
directory (keys, notes, caches) into a model that gets published. A symlink is followed only where the
Hugging Face cache puts one: a snapshot's file pointing into its own repository's ``blobs/``
(``models--org--name/snapshots/<rev>/tokenizer.json -> ../../blobs/<hash>``); any other link is skipped with
a warning.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from drivetrain_engine_core.backend import CheckpointMerger

logger = logging.getLogger(__name__)

SIDE_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "chat_template.json",
        "generation_config.json",
        "preprocessor_config.json",
    }
)
"""The files of a source model directory a merge copies: tokenizer, chat template, generation config."""

MAX_SIDE_FILE_BYTES = 64 << 20
"""Largest side file copied (the biggest tokenizer.json files are about 35 MB)."""


DTYPE_KEYS = ("torch_dtype", "dtype")
"""Where a ``config.json`` names its weights' dtype: transformers 4 reads ``torch_dtype``, 5 ``dtype``."""


def write_model_config(merger: CheckpointMerger, directory: Path, dtype: torch.dtype) -> None:
    """Write ``config.json`` for the merged model: the source config with the merged model's architecture (one
    label for a value model) and ``dtype``, the dtype of the weights written.

    Raises:
        CheckpointError: the source config cannot be read (see ``CheckpointMerger.source_config``).
    """
    config = merger.source_config()
    config["architectures"] = [merger.architecture]
    if merger.manifest.model_type == "value_model":
        # verl's critic convention: one score per token (transformers derives num_labels from id2label).
        config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        config.pop("num_labels", None)
    name = str(dtype).removeprefix("torch.")
    for key in [k for k in DTYPE_KEYS if k in config] or ["torch_dtype"]:
        config[key] = name
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_side_files(source: Path | str, directory: Path) -> list[str]:
    """Copy the allow-listed tokenizer, chat-template and generation-config files of ``source``, and the remote
    code its configs name (:func:`remote_code_files`).

    Symlinks and files over :data:`MAX_SIDE_FILE_BYTES` are skipped with a warning.

    Returns:
        The names of the copied files.
    """
    copied = []
    for name in sorted(SIDE_FILES | remote_code_files(Path(source))):
        path = Path(source) / name
        if path.is_symlink() and not _hf_cache_blob(path):
            logger.warning(
                "not copying %s: it is a symlink outside the Hugging Face cache layout (only regular files "
                "and snapshot links into their repository's blobs/ are copied)",
                path,
            )
            continue
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > MAX_SIDE_FILE_BYTES:
            logger.warning(
                "not copying %s: %d bytes is over the %d-byte cap", path, size, MAX_SIDE_FILE_BYTES
            )
            continue
        shutil.copyfile(path, directory / name)
        copied.append(name)
    return copied


def remote_code_files(source: Path) -> set[str]:
    """The Python files the ``auto_map`` of ``config.json`` and ``tokenizer_config.json`` names: a model loaded with
    ``trust_remote_code`` needs them beside its config (``save_pretrained`` copies them; without them the
    merged directory does not load).

    ``auto_map`` values are ``module.Class``, ``repo--module.Class`` (code in another repository: nothing to
    copy) or, for tokenizers, a list of such names.
    """
    files = set()
    for config_name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((source / config_name).read_text()).get("auto_map", {})
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        for value in auto_map.values():
            for reference in value if isinstance(value, list) else [value]:
                if isinstance(reference, str) and "--" not in reference and "." in reference:
                    module = reference.rsplit(".", 1)[0]
                    if module.isidentifier():
                        files.add(f"{module}.py")
    return files


def _hf_cache_blob(link: Path) -> bool:
    """Whether ``link`` is a Hugging Face cache snapshot file: ``<repo>/snapshots/<rev>/<name>`` pointing at a
    regular file in ``<repo>/blobs/``."""
    snapshot = link.parent.resolve()
    if snapshot.parent.name != "snapshots":
        return False
    target = link.resolve()
    return target.is_file() and target.parent == snapshot.parent.parent / "blobs"


__all__ = ["MAX_SIDE_FILE_BYTES", "SIDE_FILES", "copy_side_files", "remote_code_files", "write_model_config"]
