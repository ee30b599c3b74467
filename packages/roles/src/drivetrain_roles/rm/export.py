"""The reward model's start and its export as a plain Hugging Face sequence-classification folder.

The engine trains a value model (``*ForTokenClassification`` with one label, the critic's layout); its score
of a sequence is the head read at the last response token. ``*ForSequenceClassification`` reads the same
head at the last non-padding token and has the same weight names (``model.*``, ``score.weight``), so the
export is a rename of the architecture, not of the weights. Its head has no bias, so the reward model is
trained without one: the start folder's config sets ``token_classification_bias: false`` (a Bradley-Terry
loss cannot learn a bias anyway: it only sees score differences) and ``classifier_dropout: 0.0`` (the
sequence-classification head has no dropout either, so training scores what the export scores).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core import distributed
from drivetrain_engine_core.engine import Engine
from drivetrain_engine_core.errors import DrivetrainError

from ..jobs.final_model import gather_weights
from ..jobs.rank_zero_write import rank_zero_write

VALUE_START_DIR = "initial_model"
"""Where the reward model's start is written: the start model's files, its config set up for one score."""


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
"""Files of the start model that are linked, not copied: the weights (and their index)."""


def write_value_model_start(source: str, target: Path) -> str:
    """``target``: ``source``'s weights linked, its other files (tokenizer, generation config) copied, and a
    config with one label, no score bias and no head dropout (rank 0 writes); returns ``target``.

    NOTE: the small files are copied because a checkpoint merge copies the tokenizer only from regular files
    (a symlink may point anywhere): with links, a merged reward model came out without its tokenizer. The
    folder is rebuilt every time: files a previous run left there were kept, so a run in the same folder
    with another ``model.path`` (after ``--overwrite``, or a crash before its first checkpoint) trained the
    previous model's weights under the new config. The embedded model's untrained start is written to
    ``target`` itself; it is only given the reward model's config.
    """
    with rank_zero_write("the reward model's start", target):
        if distributed.rank() == 0:
            config = json.loads((Path(source) / "config.json").read_text())
            if Path(source).resolve() != target.resolve():
                _link_and_copy(Path(source), target)
            config.update(num_labels=1, token_classification_bias=False, classifier_dropout=0.0)
            (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)


def _link_and_copy(source: Path, target: Path) -> None:
    """``target`` afresh: ``source``'s weights linked, its other files but the config copied."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for entry in source.iterdir():
        destination = target / entry.name
        if entry.name == "config.json":
            continue
        if entry.name.endswith(WEIGHT_SUFFIXES) or not entry.is_file():
            os.symlink(entry.resolve(), destination)
        else:
            shutil.copyfile(entry, destination)


def export_reward_model(engine: Engine, model_path: str, tokenizer: Any, target: Path) -> None:
    """Write the trained reward model to ``target`` as ``AutoModelForSequenceClassification`` (collective).

    Raises:
        DrivetrainError: the value head has a non-zero bias (a backend that always adds one), which a
            sequence-classification head cannot hold.
    """
    weights = gather_weights(engine)
    with rank_zero_write("the reward model", target):
        if weights is not None:
            trust = engine.model_config.trust_remote_code
            model = reward_model(model_path, weights, tokenizer, trust_remote_code=trust)
            model.save_pretrained(target, safe_serialization=True)
            tokenizer.save_pretrained(target)


def reward_model(
    model_path: str, weights: dict[str, torch.Tensor], tokenizer: Any, *, trust_remote_code: bool = False
) -> Any:
    """A ``*ForSequenceClassification`` model holding the value model's ``weights``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    bias = weights.pop("score.bias", None)
    if bias is not None and bool(bias.abs().max() > 0):
        raise DrivetrainError(
            f"the reward model's value head has a bias ({float(bias.flatten()[0]):.4g}); a sequence-classification "
            "head has none, so the export would shift every score. Train from a start whose config sets "
            "token_classification_bias: false (drivetrain rm's initial_model does)."
        )
    config = AutoConfig.from_pretrained(model_path, num_labels=1, trust_remote_code=trust_remote_code)
    config.pad_token_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    model = AutoModelForSequenceClassification.from_config(
        config, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    result = model.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise DrivetrainError(
            f"the value model's weights do not fit {type(model).__name__}: missing {sorted(result.missing_keys)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}."
        )
    return model.eval()
