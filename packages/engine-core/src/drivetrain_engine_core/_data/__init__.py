"""The no-padding batch format and its transforms: building, padding conversions, response views, packing,
micro-batching and data-parallel sharding (ARCHITECTURE §4)."""

from .batch import (
    LOSS_MASK_DTYPE,
    TOKEN_FIELDS,
    expand_to_tokens,
    make_batch,
    move_batch,
    sequence_lengths,
    validate_batch,
)
from .dp import shard_data, shard_indices, unshard_data
from .groups import UID, sequence_fields, sequence_groups
from .micro_batch import (
    MicroBatchCountRule,
    MicroBatches,
    micro_batch_count,
    partition_micro_batches,
    plan_micro_batches,
    split_micro_batches,
)
from .options import ForwardOptions, refuse_batch_options
from .packing import (
    PackedRow,
    PaddedRows,
    next_token_labels,
    pack_micro_batch,
    pad_micro_batch,
    shift_right_per_sequence,
    unpack_to_jagged,
)
from .padding import nopad_to_padded, padded_to_nopad
from .partition import estimate_workload, karmarkar_karp
from .response import padded_to_response, response_to_padded, response_view
from .rows import select_rows, slice_rows
from .tokens import global_counts, global_token_count, local_token_count

__all__ = [
    "LOSS_MASK_DTYPE",
    "TOKEN_FIELDS",
    "UID",
    "ForwardOptions",
    "MicroBatchCountRule",
    "MicroBatches",
    "PackedRow",
    "PaddedRows",
    "estimate_workload",
    "expand_to_tokens",
    "global_counts",
    "global_token_count",
    "karmarkar_karp",
    "local_token_count",
    "make_batch",
    "micro_batch_count",
    "move_batch",
    "next_token_labels",
    "nopad_to_padded",
    "pack_micro_batch",
    "pad_micro_batch",
    "padded_to_nopad",
    "padded_to_response",
    "partition_micro_batches",
    "plan_micro_batches",
    "refuse_batch_options",
    "response_to_padded",
    "response_view",
    "select_rows",
    "sequence_fields",
    "sequence_groups",
    "sequence_lengths",
    "shard_data",
    "shard_indices",
    "shift_right_per_sequence",
    "slice_rows",
    "split_micro_batches",
    "unpack_to_jagged",
    "unshard_data",
    "validate_batch",
]
