"""Where each parameter's Adam moments sit in a distributed optimizer's flat checkpoint buffers.

megatron's ``dp_reshardable`` format saves the DistributedOptimizer's state as the optimizer holds it: one flat
tensor per gradient bucket and moment (``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<d>.
bucket_idx_<b>.exp_avg``), the bucket's parameters back to back. Which range belongs to which parameter only
the live optimizer knows (its buffers' ``param_index_map``); the checkpoint does not say. So at save time each
data-parallel group's rank 0 writes a record (``optimizer_layout/rank<N>-<i>.json``): for every tensor of the
model's sharded state dict (the global ``GPTModel`` key, global shape and offset that ``model/`` stores it
under), the bucket and the position in it where its moments start. :mod:`.dist_opt_record` (the reading side,
which needs no megatron import) then rebuilds full per-parameter moments offline, keyed as ``model/`` is, for
another backend or layout to load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer import MegatronOptimizer

from .dist_opt_record import LAYOUT_DIR


def write_layout(step_dir: Path, model_state: dict[str, Any], optimizer: MegatronOptimizer) -> None:
    """Write this rank's record of where ``model_state``'s tensors sit in ``optimizer``'s buckets.

    Only the data-parallel rank 0 of each distributed optimizer writes: the other ranks of its group hold the
    same buckets over the same parameters. Nothing is written for a non-distributed optimizer.

    Args:
        step_dir: the step directory being written.
        model_state: the model's sharded state dict (``model<i>`` -> chunk state), as saved in ``model/``.
        optimizer: the engine's (possibly chained) megatron optimizer.
    """
    pieces = list(_sharded_tensors(model_state))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    for index, inner in enumerate(inners):
        if not hasattr(inner, "gbuf_ranges") or inner.data_parallel_group.rank() != 0:
            continue
        # megatron's ChainedOptimizer prefixes each optimizer's keys when it chains several (a mixture of
        # experts: the dense and the expert parameters have their own optimizers and data-parallel groups).
        prefix = f"chained_{index}." if len(inners) > 1 else ""
        record = {
            "adam_step": _adam_step(inner),
            "pieces": [entry for piece in pieces if (entry := _locate(inner, piece, prefix)) is not None],
        }
        directory = step_dir / LAYOUT_DIR
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{rank}-{index}.json").write_text(json.dumps(record))


def _adam_step(inner: Any) -> int:
    """The step count of ``inner``'s torch AdamW (the same for every parameter; 0 before the first update)."""
    steps = [state["step"] for state in inner.optimizer.state.values() if "step" in state]
    return int(steps[0]) if steps else 0


def _sharded_tensors(model_state: dict[str, Any]) -> Iterator[ShardedTensor]:
    """Every ShardedTensor of ``model_state``, factories (megatron's gate/up split) built into theirs."""
    for value in nested_values(model_state):
        built = value.build() if isinstance(value, ShardedTensorFactory) else [value]
        for each in nested_values(built) if isinstance(built, (dict, list)) else [built]:
            if isinstance(each, ShardedTensor) and each.data is not None and each.flattened_range is None:
                yield each


def _locate(inner: Any, piece: ShardedTensor, prefix: str) -> dict[str, Any] | None:
    """``piece``'s checkpoint placement and where its elements start in one of ``inner``'s buckets (whose keys
    start with ``prefix``), or ``None`` when they are not in its buffers (another optimizer's parameters, or
    not a parameter)."""
    data = piece.data
    for gbuf_idx, buffer in enumerate(inner.buffers):
        base = buffer.param_data
        if base is None or data.dtype != base.dtype or not data.is_contiguous():
            continue
        position, remainder = divmod(data.data_ptr() - base.data_ptr(), base.element_size())
        if remainder or not 0 <= position < base.numel():
            continue
        (dtype,) = inner.gbuf_ranges[gbuf_idx]  # megatron keeps one dtype per buffer
        for bucket_idx, bucket in enumerate(buffer.buckets):
            if bucket.offset <= position < bucket.offset + bucket.grad_data.numel():
                return {
                    # The key megatron's sharded_param_state_dp_reshardable gives this bucket's tensors.
                    "bucket": (
                        f"{prefix}optimizer.distributed.dp_group_idx_{inner.data_parallel_group_idx}"
                        f".gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}"
                    ),
                    "start": position - bucket.offset,
                    "key": piece.key,
                    "global_shape": list(piece.global_shape),
                    "offset": list(piece.global_offset),
                    "shape": [1] * piece.prepend_axis_num + list(piece.local_shape),
                }
    return None
