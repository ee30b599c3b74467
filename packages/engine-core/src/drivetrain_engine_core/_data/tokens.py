"""The global token count that losses normalise by (ARCHITECTURE §4)."""

from __future__ import annotations

from tensordict import TensorDict

from .. import _distributed as distributed
from .._distributed import ProcessGroup
from .batch import LOSS_MASK


def local_token_count(batch: TensorDict) -> int:
    """Loss-mask tokens in ``batch`` on this rank (any mask dtype: bool, integer or 0/1 float)."""
    return int(batch[LOSS_MASK].values().sum().item())


def global_token_count(batch: TensorDict, dp_group: ProcessGroup | None = None) -> int:
    """Loss-mask tokens of the mini-batch summed over every data-parallel rank (a collective)."""
    return global_counts(batch, dp_group)[0]


def global_counts(
    batch: TensorDict, dp_group: ProcessGroup | None = None, *, count_tokens: bool = True
) -> tuple[int, int]:
    """``(loss-mask tokens, sequences)`` of the mini-batch over every data-parallel rank, in one collective.

    ``count_tokens=False`` reports 0 tokens, for batches without a ``loss_mask`` (inference).
    """
    tokens = local_token_count(batch) if count_tokens else 0
    total_tokens, total_sequences = distributed.all_reduce_sums([tokens, len(batch)], dp_group)
    return int(total_tokens), int(total_sequences)
