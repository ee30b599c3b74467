"""Per-position fields of one micro-batch from the last pipeline stage's model output.

Language models: ``log_probs`` (and ``entropy``) from the last hidden states and this rank's rows of the
output projection (:mod:`.head`), through core's chunked ``linear_log_probs`` with the softmax statistics
all-reduced over the tensor-parallel group, so neither full nor vocabulary-parallel logits of the micro-batch
ever exist. Value models: ``values`` from the one-output value head. Both stay per position ("position p
predicts token p + 1"); core's ``MicroBatch.finish`` shifts and unpacks them (docs §7.1 alignment).
"""

from __future__ import annotations

import torch
from drivetrain_engine_core.backend import MicroBatch
from drivetrain_engine_core.kit import linear_log_probs

from .head import OutputShard


def language_model_fields(
    hidden: torch.Tensor, micro_batch: MicroBatch, shard: OutputShard, chunk_size: int
) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) from ``GPTModel``'s last hidden states ``(batch, seq, hidden)``.

    Args:
        hidden: the model output with its output layer passed through (:func:`.head.hidden_states_out`).
        micro_batch: the micro-batch the output was computed for.
        shard: this rank's rows of the output projection.
        chunk_size: positions whose (vocabulary-parallel) logits exist at once.
    """
    options = micro_batch.options
    log_probs, entropy = linear_log_probs(
        micro_batch.rows(hidden),
        shard.weight,
        micro_batch.labels,
        temperature=options.temperature,
        compute_entropy=options.compute_entropy,
        chunk_size=chunk_size,
        group=shard.group,
        vocab_start=shard.vocab_start,
        vocab_size=shard.vocab_size,
    )
    return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}


def value_fields(values: torch.Tensor, micro_batch: MicroBatch) -> dict[str, torch.Tensor]:
    """``values`` from the value head's output ``(batch, seq, 1)``."""
    return {"values": micro_batch.rows(values).squeeze(-1).float()}
