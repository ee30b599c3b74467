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

import filecmp
import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from drivetrain_engine_core.backend import CheckpointError, DrivetrainError, Engine
from drivetrain_engine_core.kit import distributed

from ..jobs.final_model import gather_weights
from ..jobs.rank_zero_write import rank_zero_write

VALUE_START_DIR = "initial_model"
"""Where the reward model's start is written: the start model's files, its config set up for one score."""


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
"""Files of the start model that are linked, not copied: the weights (and their index)."""

StartEntry = tuple[Literal["config", "link", "copy"], str]
"""One entry of the start folder: ``("config", text)``, ``("link", target)`` or ``("copy", source file)``."""


def write_value_model_start(source: str, target: Path, *, resume: bool = False) -> str:
    """``target``: ``source``'s weights linked, its other files (tokenizer, generation config) copied, and a
    config with one label, no score bias and no head dropout (rank 0 writes); returns ``target``.

    With ``resume``, a ``target`` already there is checked, not written: the resumed checkpoint was trained
    from it, and a resume refused later (another seed) must leave the run folder as it was.

    NOTE: the small files are copied because a checkpoint merge copies the tokenizer only from regular files
    (a symlink may point anywhere): with links, a merged reward model came out without its tokenizer. The
    folder is rebuilt by every new run: files a previous run left there were kept, so a run in the same folder
    with another ``model.path`` (after ``--overwrite``, or a crash before its first checkpoint) trained the
    previous model's weights under the new config. The embedded model's untrained start is written to
    ``target`` itself; it is only given the reward model's config.

    Raises:
        CheckpointError: with ``resume``, ``target`` was made from another model than ``source`` (every rank).
    """
    with rank_zero_write("the reward model's start", target):
        if distributed.rank() == 0:
            in_place = Path(source).resolve() == target.resolve()
            entries = _start_entries(Path(source), target, in_place=in_place)
            if resume and (target / "config.json").is_file():
                _check_start(source, target, entries, in_place=in_place)
            else:
                _write_start(target, entries, in_place=in_place)
    return str(target)


def _start_entries(source: Path, target: Path, *, in_place: bool) -> dict[str, StartEntry]:
    """The start folder's entries by name; in place, only the config (the other files are the start's own).

    NOTE: a link to a file of the same run folder (the warm start's final model) is relative, so a run folder
    moved or copied whole still resumes: its absolute links named the old place.
    """
    config = json.loads((source / "config.json").read_text())
    config.update(num_labels=1, token_classification_bias=False, classifier_dropout=0.0)
    entries: dict[str, StartEntry] = {"config.json": ("config", json.dumps(config, indent=2))}
    run = target.parent.resolve()
    for entry in [] if in_place else sorted(source.iterdir()):
        if entry.name == "config.json":
            continue
        if entry.name.endswith(WEIGHT_SUFFIXES) or not entry.is_file():
            linked = entry.resolve()
            relative = linked.is_relative_to(run)
            entries[entry.name] = ("link", os.path.relpath(linked, target) if relative else str(linked))
        else:
            entries[entry.name] = ("copy", str(entry))
    return entries


def _write_start(target: Path, entries: dict[str, StartEntry], *, in_place: bool) -> None:
    """Write ``entries`` to ``target``, afresh unless ``in_place``."""
    if not in_place:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
    for name, (kind, value) in entries.items():
        if kind == "link":
            os.symlink(value, target / name)
        elif kind == "copy":
            shutil.copyfile(value, target / name)
        else:
            (target / name).write_text(value)


def _check_start(source: str, target: Path, entries: dict[str, StartEntry], *, in_place: bool) -> None:
    """Refuse a ``target`` that does not hold ``entries`` (and, unless ``in_place``, nothing else).

    NOTE: keeping the folder as it is would quietly train the run's first model under another ``model.path``;
    rebuilding it before the checkpoint is checked wrote into the run folder on a resume refused there.
    """
    names = sorted(p.name for p in target.iterdir())
    if (in_place or names == sorted(entries)) and all(
        _holds(target / name, kind, value) for name, (kind, value) in entries.items()
    ):
        return
    links = [target / name for name in names if (target / name).is_symlink()]
    made_from = str(links[0].resolve().parent) if links else "its own files, the embedded model"
    raise CheckpointError(
        f"{target} was made from another model ({made_from}) than this --resume starts from ({source}), and the "
        "run's checkpoints were trained from it. Set model.path (and warm_start.sft_steps) as the run had them, "
        "or start a new run without --resume."
    )


def _holds(path: Path, kind: str, value: str) -> bool:
    """Whether ``path`` is the start folder's entry ``(kind, value)`` (see :func:`_start_entries`)."""
    if kind == "link":  # the same file (a start written before its links were relative held absolute ones)
        return path.is_symlink() and path.resolve() == (path.parent / value).resolve()
    if path.is_symlink() or not path.is_file():
        return False
    return filecmp.cmp(value, path, shallow=False) if kind == "copy" else path.read_text() == value


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
