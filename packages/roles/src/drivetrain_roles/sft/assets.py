"""Materialising a run's inputs: the embedded model and generated data, written once by rank 0."""

from __future__ import annotations

from pathlib import Path

from drivetrain_engine_core import distributed as dist_utils
from drivetrain_engine_core.config import ConfigError

from .config import DataConfig
from .default_assets import BUILTIN_MODEL, write_arithmetic_data, write_model_dir


def resolve_model_path(path: str, output_dir: Path, seed: int) -> str:
    """``path`` itself, or for ``builtin:arithmetic`` the embedded model under ``<output_dir>/model``.

    Raises:
        ConfigError: ``path`` is a local directory without ``config.json`` (not a Hugging Face model).
    """
    if path != BUILTIN_MODEL:
        if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"model.path={path} is a directory without config.json, so it is not a Hugging Face model "
                "directory; point model.path at one (config.json, tokenizer files, weights)."
            )
        return path
    target = output_dir / "model"
    if dist_utils.rank() == 0 and not (target / "config.json").is_file():
        write_model_dir(target, seed=seed)
    dist_utils.barrier()
    return str(target)


def resolve_data_files(config: DataConfig, output_dir: Path, seed: int) -> tuple[list[str], list[str]]:
    """Train and held-out files: the configured ones, or the generated arithmetic splits under ``<output_dir>/data``."""
    if not config.generated:
        return list(config.train_files), list(config.val_files)
    directory = output_dir / "data"
    train, val = directory / "train.jsonl", directory / "val.jsonl"
    if dist_utils.rank() == 0 and not (train.is_file() and val.is_file()):
        write_arithmetic_data(
            directory, train_size=config.generated_train_size, val_size=config.generated_val_size, seed=seed
        )
    dist_utils.barrier()
    return [str(train)], [str(val)] if config.generated_val_size else []
