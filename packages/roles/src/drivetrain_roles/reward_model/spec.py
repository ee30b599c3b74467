"""A reward model named among the reward functions: how an ``algorithm.reward_functions`` entry is read as a
model, its name in the metrics, and the checks of its folder (torch-free: the config checks run them).

An entry that is neither a built-in reward nor ``package.module:function`` / ``path/to/file.py:function`` (it has
no ``:``) is a model folder, as TRL's ``reward_funcs`` takes a model id beside its functions: a Hugging Face
``*ForSequenceClassification`` model with one label (``drivetrain rm``'s ``final_model``, or any reward model
saved with ``save_pretrained``). Its weight is its ``algorithm.reward_weights`` entry, its value is logged as
``reward/<name>``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import ConfigError

SCORE_WEIGHT = "score.weight"
"""The sequence-classification head both engines load as a value head (``*ForTokenClassification``'s names)."""
EXPORT_DIR = "final_model"
"""The folder a drivetrain run exports its model to: such a model is named after its run folder instead."""


def is_model_spec(spec: str) -> bool:
    """Whether a reward entry that is not a built-in names a model folder: no ``module:function``, and no
    Python file (``rewards.py`` lacks its ``:function``, which the function loader's message says)."""
    return ":" not in spec and not spec.endswith(".py")


def model_name(spec: str) -> str:
    """The model's name in the metrics: its folder's name, or its run's for a drivetrain export
    (``runs/rm/final_model`` -> ``rm``)."""
    path = Path(spec.rstrip("/"))
    return path.parent.name if path.name == EXPORT_DIR and path.parent.name else path.name


def check_model_folder(spec: str) -> Path:
    """The folder ``spec`` names, checked to hold a one-label sequence-classification model with a ``score``
    head.

    Raises:
        ConfigError: no ``config.json`` there, another architecture, ``num_labels`` other than 1, or weights
            without ``score.weight``; each naming the fix.
    """
    path = Path(spec).expanduser()
    label = f"algorithm.reward_functions entry {spec!r}"
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{label} is no built-in reward and no package.module:function or path/to/file.py:function, so it "
            f"names a reward model folder, but {path} has no config.json. Give the folder of a Hugging Face "
            "sequence-classification model (drivetrain rm's <run>/final_model; a Hub model: download it first, "
            "huggingface-cli download <id> --local-dir <folder>), or a function as package.module:function."
        )
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            f"{label}: {path} holds {architectures or 'a model without architectures'}, not a "
            "*ForSequenceClassification model; a reward model scores a whole sequence with one number. Train one "
            "with drivetrain rm (its final_model), or save a reward model with "
            "AutoModelForSequenceClassification.save_pretrained."
        )
    labels = num_labels(config)
    if labels != 1:
        raise ConfigError(
            f"{label}: {path} is a classifier with num_labels={labels}; a reward is one number per sequence, so "
            "a reward model has num_labels=1. Give a reward model (drivetrain rm's final_model), or score with "
            "this classifier in a reward function (package.module:function)."
        )
    names = weight_names(path)
    if names and SCORE_WEIGHT not in names:
        raise ConfigError(
            f"{label}: the weights in {path} hold no {SCORE_WEIGHT} (the head drivetrain reads a score from; "
            f"heads found: {sorted(n for n in names if not n.startswith('model.'))[:5]}). Give a decoder reward "
            "model whose head is named score (Qwen2, Llama, Mistral, Gemma ...ForSequenceClassification)."
        )
    return path


def num_labels(config: dict[str, Any]) -> int:
    """The labels of a transformers config as it reads them: ``id2label``'s, else ``num_labels``, else 2."""
    if "id2label" in config:
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def weight_names(path: Path) -> set[str]:
    """The tensor names of the ``*.safetensors`` files in ``path`` (from their headers; empty without any)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
    return names
