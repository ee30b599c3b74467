"""Forward options that travel with a batch as non-tensor metadata (ARCHITECTURE §4).

Options are read once at the top of ``forward_backward_batch`` and removed from the batch before it is split.
An option is a ``NonTensorData`` entry (one value for the batch); ``NonTensorStack`` entries are per-sequence
fields (``uid``, ``data_source``: :mod:`.groups`) that travel with their sequences, not options. An option
the engine does not know is an error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from tensordict import TensorDict

from ..errors import BatchError
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


def _non_tensor_keys(batch: TensorDict) -> list[str]:
    """Keys of the batch's options: non-tensor entries other than per-sequence fields."""
    keys = field_names(batch)
    return [key for key in keys if not _is_tensor(batch, key) and not is_sequence_field(batch.get(key))]


def _is_tensor(batch: TensorDict, key: str) -> bool:
    import torch

    return isinstance(batch.get(key), torch.Tensor) and not _is_non_tensor(batch, key)


def _is_non_tensor(batch: TensorDict, key: str) -> bool:
    from tensordict import NonTensorData, NonTensorStack

    return isinstance(batch.get(key), (NonTensorData, NonTensorStack)) or not hasattr(batch.get(key), "shape")


def read_forward_options(batch: TensorDict) -> ForwardOptions:
    """The options stored in ``batch`` (defaults for the ones not set).

    Raises:
        BatchError: a non-tensor entry is not a known option.
    """
    values = {}
    for key in _non_tensor_keys(batch):
        if key not in OPTION_NAMES:
            close = difflib.get_close_matches(key, OPTION_NAMES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise BatchError(f"unknown batch option {key!r}; known options: {list(OPTION_NAMES)}.{hint}")
        values[key] = batch.get_non_tensor(key)
    return ForwardOptions(**values)


def set_forward_options(batch: TensorDict, **options: object) -> TensorDict:
    """Store options on ``batch`` (validated) and return it."""
    ForwardOptions(**options)  # type: ignore[arg-type]
    for key, value in options.items():
        batch.set_non_tensor(key, value)
    return batch


def strip_forward_options(batch: TensorDict) -> TensorDict:
    """A shallow copy of ``batch`` without its non-tensor options."""
    keys = _non_tensor_keys(batch)
    return batch.exclude(*keys) if keys else batch
