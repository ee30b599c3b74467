"""Distributed-optimizer checkpoints whose buckets end in alignment padding (megatron-core 0.16).

The ``dp_reshardable`` optimizer format writes each gradient bucket as one flat tensor of the bucket's
*unpadded* size and fills gaps between parameters with padding shards. megatron-core 0.16 lets the last
padding shard of a rank run to the physical end of the bucket, past that size, and torch's distributed
checkpoint then refuses the whole save plan ("out of bounds chunk"). It happens when a bucket boundary falls
inside the padding: e.g. a tied output layer on the last of two pipeline stages. Upstream fixes it the same way
(Megatron-LM pull request 5898, "exclude bucket-end padding from optimizer checkpoints"): such a shard is cut at
the bucket's unpadded end; the part cut off is runtime padding that holds nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor


def clip_padding_past_bucket_end(sharded_state: dict[str, Any]) -> dict[str, Any]:
    """``sharded_state`` (from ``optimizer.sharded_state_dict``) with every flat shard cut to its tensor's size.

    Applied alike when saving and when loading, so both sides describe the same chunks.
    """
    return dict_list_map_inplace(_clipped, sharded_state)


def _clipped(value: Any) -> Any:
    if not isinstance(value, ShardedTensor) or len(value.global_shape) != 1 or value.prepend_axis_num:
        return value
    room = value.global_shape[0] - value.global_offset[0]
    if value.local_shape[0] <= room:
        return value
    data = value.data[:room] if value.data is not None else None
    return dataclasses.replace(value, data=data, local_shape=(room,))
