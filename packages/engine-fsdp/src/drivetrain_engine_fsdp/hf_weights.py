"""Fill sharded parameters from a Hugging Face safetensors directory, each rank reading only its own slices.

The reading is torch's: ``torch.distributed.checkpoint`` with its ``HuggingFaceStorageReader`` plans, for every
rank, the slices of each tensor that its DTensor shards cover and reads just those (``safe_open`` +
``get_slice``), one file at a time, converting the on-disk dtype into the parameter's (bf16 on disk into float32
master weights: an exact widening, as ``from_pretrained(dtype=float32)`` does). No rank ever holds a full
tensor, and a tensor one rank does not own is never read there.

What drivetrain adds is the check before any reading: the checkpoint's names and shapes against the model the
config describes, so a directory without weights, a shard that disagrees with ``config.json`` or the weights
of another architecture fail with the names that are missing and the names that were found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core.backend import CheckpointError
from drivetrain_engine_core.kit import CheckpointIndex
from torch.distributed.checkpoint import HuggingFaceStorageReader

_SHOWN = 5  # names listed in an error message before "... and N more"


def check_checkpoint(
    index: CheckpointIndex, expected: Mapping[str, tuple[int, ...]], *, may_be_fresh: Iterable[str] = ()
) -> set[str]:
    """Which of the ``expected`` weights the checkpoint holds; raise when it does not hold what it must.

    Args:
        index: the checkpoint.
        expected: checkpoint name -> shape of every weight the model (as its config describes it) needs.
        may_be_fresh: names the engine initialises itself when the checkpoint lacks them (a value head on a
            language-model checkpoint, as ``from_pretrained`` does).

    Returns:
        The names to read from the checkpoint.

    Raises:
        CheckpointError: a needed name is missing (the message lists the missing names and the checkpoint
            names nothing asked for: another architecture's weights show up there), or a shape differs from
            the config's.
    """
    missing = sorted(set(expected) - set(index.shapes) - set(may_be_fresh))
    if missing:
        unused = sorted(set(index.shapes) - set(expected))
        raise CheckpointError(
            f"the weights in {index.path} do not fit the model its config.json describes: "
            f"{len(missing)} of its {len(expected)} weights are missing ({_names(missing)}); "
            f"the checkpoint holds {len(index.shapes)} tensors, of which these match no weight: {_names(unused)}. "
            "Check that config.json and the *.safetensors files come from the same model (architecture and "
            "transformers version); weights saved under other names need engine.meta_init=False, which loads "
            "through from_pretrained and its name conversions."
        )
    wrong = [
        f"{name}: config gives {list(shape)}, checkpoint holds {list(index.shapes[name])}"
        for name, shape in sorted(expected.items())
        if name in index.shapes and tuple(index.shapes[name]) != tuple(shape)
    ]
    if wrong:
        raise CheckpointError(
            f"the weights in {index.path} disagree with its config.json in {len(wrong)} shape(s): "
            f"{'; '.join(wrong[:_SHOWN])}{_more(len(wrong))}. Use the config.json the weights were saved with."
        )
    return set(expected) & set(index.shapes)


def load_checkpoint_shards(index: CheckpointIndex, targets: Mapping[str, torch.Tensor]) -> None:
    """Read every tensor of ``targets`` (checkpoint name -> DTensor or plain tensor) in place, in parallel.

    A collective on every rank: DCP agrees one read plan across ranks, then each rank reads only the slices
    of its local shards.
    """
    dcp.load(dict(targets), storage_reader=HuggingFaceStorageReader(str(index.path)))


def _names(names: list[str]) -> str:
    return f"{names[:_SHOWN]}{_more(len(names))}" if names else "none"


def _more(count: int) -> str:
    return f" and {count - _SHOWN} more" if count > _SHOWN else ""
