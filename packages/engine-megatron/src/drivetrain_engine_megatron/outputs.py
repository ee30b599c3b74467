"""Per-position fields of one micro-batch from the last pipeline stage's model output.

Language models: ``log_probs`` (and ``entropy``) from vocabulary-parallel logits; value models: ``values``
from the one-output value head. Both stay per position ("position p predicts token p + 1"); core's
``MicroBatch.finish`` shifts and unpacks them (docs §7.1 alignment).
"""

from __future__ import annotations

import torch
from drivetrain_engine_core.backend import MicroBatch

from .vocab_parallel import vocab_parallel_log_probs_and_entropy


def language_model_fields(
    logits: torch.Tensor, micro_batch: MicroBatch, vocab_size: int
) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) from ``GPTModel`` logits ``(batch, seq, vocab / TP)``."""
    options = micro_batch.options
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        micro_batch.rows(logits),
        micro_batch.labels,
        vocab_size=vocab_size,
        temperature=options.temperature,
        with_entropy=options.compute_entropy,
    )
    return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}


def value_fields(values: torch.Tensor, micro_batch: MicroBatch) -> dict[str, torch.Tensor]:
    """``values`` from the value head's output ``(batch, seq, 1)``."""
    return {"values": micro_batch.rows(values).squeeze(-1).float()}
