"""The output layer, run by the engine instead of ``GPTModel`` so that vocabulary-parallel logits never exist.

``GPTModel`` ends ``logits, _ = output_layer(hidden, weight=shared_weight)``, a bias-free
``ColumnParallelLinear`` whose rows are split over the tensor-parallel ranks (tied to the embedding or not).
During the engine's forward the layer hands its input back instead (:func:`hidden_states_out`), so the model
returns the last hidden states ``(batch, seq, hidden)``; the token fields are then computed from them and this
rank's rows of the projection (:func:`output_shard`) by core's ``linear_log_probs``, which keeps only one
chunk of this rank's logits at a time and all-reduces the softmax statistics over the tensor-parallel group.
Value models keep their one-output head (:mod:`.value_head`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from drivetrain_engine_core.backend import ConfigError
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


@dataclass(frozen=True)
class OutputShard:
    """This rank's rows of the output projection, as core's ``linear_log_probs`` takes them.

    Attributes:
        weight: ``(vocab / TP, hidden)`` rows ``vocab_start ..`` of the projection (the embedding when tied).
        group: the tensor-parallel group, or ``None`` when this rank holds the whole vocabulary (TP = 1).
        vocab_start: id of ``weight``'s first row.
        vocab_size: the tokenizer's vocabulary; rows at or beyond it are padding.
    """

    weight: torch.Tensor
    group: dist.ProcessGroup | None
    vocab_start: int
    vocab_size: int


def check_output_layer(model: Any, hf_model_type: str) -> None:
    """Refuse a last-stage ``GPTModel`` whose logits are more than its hidden states times one weight.

    Raises:
        ConfigError: the output layer is not a bias-free, vocabulary-parallel ``ColumnParallelLinear``, or the
            model adds multi-token-prediction layers after it.
    """
    reason = _unsupported_output(model)
    if reason is not None:
        raise ConfigError(
            f"the megatron backend computes log-probs from the last hidden states and this rank's rows of the "
            f"output layer's weight; the {hf_model_type!r} model built by mbridge cannot take that path: "
            f"{reason}. Use backend 'fsdp' for this model."
        )


def _unsupported_output(model: Any) -> str | None:
    """Why the logits of ``model`` are not ``hidden @ weight.T`` over a vocabulary split by rows, or ``None``."""
    layer: Any = getattr(model, "output_layer", None)
    if type(layer) is not ColumnParallelLinear:
        return f"its output layer is a {type(layer).__name__}, not megatron's ColumnParallelLinear"
    if layer.bias is not None:
        return "its output layer has a bias"
    if layer.gather_output:
        return "its output layer gathers the logits over tensor-parallel ranks (parallel_output=False)"
    mtp_layers = getattr(model.config, "mtp_num_layers", None)
    if mtp_layers is not None:
        return f"it has {mtp_layers} multi-token-prediction layers after the output layer"
    return None


def output_shard(model: Any, vocab_size: int) -> OutputShard:
    """The projection rows of last-stage ``GPTModel`` ``model`` on this rank (read after its forward)."""
    layer = model.output_layer
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else layer.weight
    )
    group = layer.tp_group if layer.tp_group.size() > 1 else None
    rank = dist.get_rank(group) if group is not None else 0
    return OutputShard(weight=weight, group=group, vocab_start=rank * weight.shape[0], vocab_size=vocab_size)


@contextmanager
def hidden_states_out(model: Any) -> Iterator[None]:
    """Inside the block ``model.output_layer`` returns ``(hidden, None)``: ``GPTModel``'s output is the hidden
    states, gathered along the sequence first under sequence parallelism (as the layer would gather them).

    NOTE: an instance attribute shadows ``ColumnParallelLinear.forward`` only for this call; parameters,
    hooks and state dict names are untouched.
    """
    layer = model.output_layer

    def passthrough(
        hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        if not layer.sequence_parallel:
            return hidden, None
        # NOTE: the backward only splits: core's linear_log_probs already sums the hidden states' gradient
        # over the tensor-parallel group, where the layer's own backward would reduce-scatter it.
        return gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False, group=layer.tp_group
        ), None

    layer.forward = passthrough
    try:
        yield
    finally:
        del layer.forward
