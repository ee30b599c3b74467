"""The global token count that losses normalise by (ARCHITECTURE §4)."""

from __future__ import annotations

from tensordict import TensorDict

from .. import distributed as dist_utils
from ..distributed import ProcessGroup
from .batch import LOSS_MASK


def local_token_count(batch: TensorDict) -> int:
    """Loss-mask tokens in ``batch`` on this rank (any mask dtype: bool, integer or 0/1 float)."""
    return int(batch[LOSS_MASK].values().sum().item())


def global_token_count(batch: TensorDict, dp_group: ProcessGroup | None = None) -> int:
    """Loss-mask tokens of the mini-batch summed over every data-parallel rank (a collective)."""
    return int(dist_utils.all_reduce_sum(local_token_count(batch), dp_group))
