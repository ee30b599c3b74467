"""Forward options: an argument of ``forward_backward_batch`` / ``infer_batch`` / ``train_batch`` (ARCHITECTURE §4).

Batches carry tensors, plus per-sequence non-tensor fields (``NonTensorStack``: ``uid``, ``data_source``, see
:mod:`.groups`) that travel with their sequences. Options used to travel as batch-level non-tensor metadata; a
batch that still carries such an entry is refused with the argument to use instead, so an option is never
silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from .._errors import BatchError
from .batch import field_names
from .groups import is_sequence_field


@dataclass(kw_only=True, frozen=True)
class ForwardOptions:
    """Options of one forward pass.

    Attributes:
        temperature: logits are divided by it before log-probs and entropy (sampling temperature of the rollout).
        compute_entropy: also return per-token ``entropy``.
    """

    temperature: float = 1.0
    compute_entropy: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise BatchError(f"option temperature must be > 0, got {self.temperature}.")


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ForwardOptions))


def refuse_batch_options(batch: TensorDict) -> None:
    """Refuse batch-level non-tensor entries in ``batch``: options are an argument, never batch metadata.

    Per-sequence non-tensor fields (one value per sequence) are data, not options, and pass.

    Raises:
        BatchError: naming the entry, the option it resembles and the ``options=`` argument to use.
    """
    for key in field_names(batch):
        value = batch.get(key)
        if is_sequence_field(value):
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, (NonTensorData, NonTensorStack)):
            continue
        close = difflib.get_close_matches(key, OPTION_NAMES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise BatchError(
            f"batch entry {key!r} is not a tensor; batches carry tensors only. Forward options "
            f"{list(OPTION_NAMES)} are an argument: engine.infer_batch(batch, options=ForwardOptions(...)) "
            f"(also forward_backward_batch and train_batch).{hint}"
        )
