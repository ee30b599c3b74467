"""Materialising a run's inputs: the embedded model and generated data, written once by rank 0."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import DrivetrainError
from drivetrain_engine_core.kit import distributed

from ..command_sections import DataConfig
from .builtin_tasks import ARITHMETIC, BUILTIN_TASKS, BuiltinTask, builtin_task
from .data import Example, load_examples

INITIAL_MODEL_DIR = "initial_model"
"""Where the embedded model is written before training (random weights: the run's starting point)."""


HUB_MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py")
"""What a run needs of a Hub repository: config, weights and their index, tokenizer and chat template files,
and the modeling code of a ``model.trust_remote_code`` model (not the ``.bin``/``.pth``/``.gguf`` copies
many repositories also carry)."""

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(path: str, output_dir: Path, seed: int, *, resume: bool = False) -> str:
    """The local model directory a run trains: ``path``, its Hub snapshot in the Hugging Face cache (fetched
    by :func:`check_model_path` before the run), or for an embedded task (``builtin:<name>``) its untrained
    model under ``<run>/initial_model``.

    Raises:
        ModelPathError: ``path`` is neither a local Hugging Face model directory nor a cached Hub repository.
    """
    task = builtin_task(path)
    if task is None:
        return model_directory(path)
    target = output_dir / INITIAL_MODEL_DIR
    # NOTE: written by every new run (kept from an earlier one, it ignored a new --overwrite run's engine.seed);
    # a resumed run keeps the one it started from.
    if distributed.rank() == 0 and not (resume and (target / "config.json").is_file()):
        task.write_model(target, seed)
    distributed.barrier()
    return str(target)


def same_model_path(first: str, second: str) -> bool:
    """Whether two ``model.path`` values name the same model: equal, or the same directory on this machine (a
    Hub repository id stands for its cached snapshot, so ``org/name`` and that snapshot's path are one model;
    once the cache holds a newer revision they are not)."""
    if first == second:
        return True
    one, other = local_model_directory(first), local_model_directory(second)
    return one is not None and other is not None and os.path.samefile(one, other)


def local_model_directory(path: str) -> str | None:
    """``path`` if it is a directory, a Hub repository id's cached snapshot, or None (the Hub is not asked)."""
    if Path(path).is_dir():
        return path
    try:
        return model_directory(path)
    except ModelPathError:
        return None


def is_hub_id(path: str) -> bool:
    """Whether ``model.path`` names a Hub repository (``org/name`` that is not a local path)."""
    return not Path(path).exists() and _REPO_ID.fullmatch(path) is not None


class ModelPathError(DrivetrainError, FileNotFoundError):
    """``model.path`` names neither a local Hugging Face model directory nor a Hub repository this machine has."""


def check_model_path(path: str) -> None:
    """Raise one clear error unless ``path`` is an embedded model, a model directory, or a Hub repository id
    whose files are in (or can be fetched into) the Hugging Face cache; commands call it once, before any rank
    starts, so a Hub model is downloaded once."""
    if builtin_task(path) is None:
        model_directory(path, download=True)


def model_directory(path: str, *, download: bool = False) -> str:
    """The local directory of ``path``: ``path`` itself, or for a Hub repository id (``org/name`` that is not
    a local path) its snapshot in the Hugging Face cache, fetched first when ``download`` (and the Hub is
    reachable; ``HF_HUB_OFFLINE=1`` never asks it).

    Raises:
        ModelPathError: no ``config.json`` there, or the repository is neither cached nor fetchable.
    """
    directory = Path(path)
    if is_hub_id(path):
        directory = Path(_hub_snapshot(path, download=download))
    if not (directory / "config.json").is_file():
        what = "has no config.json" if directory.is_dir() else "does not exist"
        raise ModelPathError(
            f"model.path={path} {what}; set model.path to a local Hugging Face model directory (config.json, "
            f"weights, tokenizer), a Hub repository id such as Qwen/Qwen2.5-0.5B-Instruct, or an embedded model: "
            f"{' or '.join(BUILTIN_TASKS)}."
        )
    return str(directory)


def _hub_snapshot(repo_id: str, *, download: bool) -> str:
    from huggingface_hub import snapshot_download

    try:
        return str(
            snapshot_download(repo_id, allow_patterns=list(HUB_MODEL_FILES), local_files_only=not download)
        )
    except (OSError, ValueError) as e:  # every Hub, cache and validation error of huggingface_hub
        reason = " ".join(str(e).split())
        raise ModelPathError(
            f"model.path={repo_id} is not a local directory, and the Hugging Face Hub repository of that name is "
            f"not in this machine's cache{' and could not be fetched' if download else ''} ({type(e).__name__}: "
            f"{reason[:300]}). Fetch it where the Hub is reachable (`hf download {repo_id}`, into the cache "
            "HF_HOME points at), or set model.path to a local model directory."
        ) from e


def resolve_data_files(
    config: DataConfig, output_dir: Path, seed: int, *, resume: bool = False, task: BuiltinTask = ARITHMETIC
) -> tuple[list[str], list[str]]:
    """Train and held-out files: the configured ones, or ``task``'s generated splits under ``<output_dir>/data``
    (written by every new run; a resumed run keeps the ones it started from)."""
    if not config.generated:
        return list(config.train_files), list(config.val_files)
    directory = output_dir / "data"
    train, val = directory / "train.jsonl", directory / "val.jsonl"
    # NOTE: like the embedded model: kept from an earlier run, it ignored a new run's sizes or seed.
    if distributed.rank() == 0 and not (resume and train.is_file() and val.is_file()):
        task.write_data(
            directory, train_size=config.generated_train_size, val_size=config.generated_val_size, seed=seed
        )
    distributed.barrier()
    return [str(train)], [str(val)] if config.generated_val_size else []


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of the model directory ``model_path``.

    Raises:
        ModelPathError: the tokenizer knows at most one token: the directory has no tokenizer files.
            transformers 5 then builds an empty tokenizer (its EOS alone), every example became the bare EOS,
            and a run "trained" with loss 0.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if len(tokenizer) <= 1:
        raise ModelPathError(
            f"the tokenizer of {model_path} knows {len(tokenizer)} token(s) and encodes no text: the directory has "
            "no tokenizer files (tokenizer.json, tokenizer_config.json, vocab/merges); copy them from the model "
            "it was made from."
        )
    return tokenizer


def load_splits(
    model_path: str,
    config: DataConfig,
    output_dir: Path,
    seed: int,
    *,
    resume: bool = False,
    trust_remote_code: bool = False,
    task: BuiltinTask = ARITHMETIC,
) -> tuple[Any, list[Example], list[Example]]:
    """The model's tokenizer and the tokenised train and held-out examples of ``config`` (``task``'s generated
    splits when it names no files: :func:`~.builtin_tasks.data_task`); shared by ``sft`` and ``grpo``."""
    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    train_files, val_files = resolve_data_files(config, output_dir, seed, resume=resume, task=task)
    train = load_examples(train_files, tokenizer, config)
    val = load_examples(val_files, tokenizer, config, held_out=True) if val_files else []
    return tokenizer, train, val
