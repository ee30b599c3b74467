"""Materialising a run's inputs: the embedded model and generated data, written once by rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain_engine_core import distributed
from drivetrain_engine_core.errors import DrivetrainError

from .config import DataConfig
from .data import Example, load_examples
from .default_assets import BUILTIN_MODEL, write_arithmetic_data, write_model_dir

INITIAL_MODEL_DIR = "initial_model"
"""Where the embedded model is written before training (random weights: the run's starting point)."""


def resolve_model_path(path: str, output_dir: Path, seed: int) -> str:
    """``path`` itself, or for ``builtin:arithmetic`` the embedded untrained model under ``<run>/initial_model``.

    Raises:
        ModelPathError: ``path`` is not a local Hugging Face model directory.
    """
    if path != BUILTIN_MODEL:
        check_model_path(path)
        return path
    target = output_dir / INITIAL_MODEL_DIR
    if distributed.rank() == 0 and not (target / "config.json").is_file():
        write_model_dir(target, seed=seed)
    distributed.barrier()
    return str(target)


class ModelPathError(DrivetrainError, FileNotFoundError):
    """``model.path`` does not name a local Hugging Face model directory."""


def check_model_path(path: str) -> None:
    """Raise one clear error unless ``path`` is the embedded model or a directory with a ``config.json``."""
    if path == BUILTIN_MODEL:
        return
    directory = Path(path)
    if not (directory / "config.json").is_file():
        what = "has no config.json" if directory.is_dir() else "does not exist"
        raise ModelPathError(
            f"model.path={path} {what}; set model.path to a local Hugging Face model directory (config.json, "
            f"weights, tokenizer; e.g. `hf download <repo> --local-dir DIR`) or to {BUILTIN_MODEL} for the "
            "embedded model."
        )


def resolve_data_files(config: DataConfig, output_dir: Path, seed: int) -> tuple[list[str], list[str]]:
    """Train and held-out files: the configured ones, or the generated arithmetic splits under ``<output_dir>/data``."""
    if not config.generated:
        return list(config.train_files), list(config.val_files)
    directory = output_dir / "data"
    train, val = directory / "train.jsonl", directory / "val.jsonl"
    if distributed.rank() == 0 and not (train.is_file() and val.is_file()):
        write_arithmetic_data(
            directory, train_size=config.generated_train_size, val_size=config.generated_val_size, seed=seed
        )
    distributed.barrier()
    return [str(train)], [str(val)] if config.generated_val_size else []


def load_splits(
    model_path: str, config: DataConfig, output_dir: Path, seed: int
) -> tuple[Any, list[Example], list[Example]]:
    """The model's tokenizer and the tokenised train and held-out examples of ``config`` (the generated
    arithmetic splits for the embedded task); shared by ``sft`` and ``grpo``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_files, val_files = resolve_data_files(config, output_dir, seed)
    train = load_examples(train_files, tokenizer, config)
    val = load_examples(val_files, tokenizer, config) if val_files else []
    return tokenizer, train, val
