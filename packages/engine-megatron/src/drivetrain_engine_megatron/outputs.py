"""Per-token outputs of one micro-batch from the last pipeline stage's model output (docs §7.1 alignment).

Language models: ``log_probs`` (and ``entropy``) from vocabulary-parallel logits; value models: ``values``
from the one-output value head. Both are computed at packed position ``p`` for token ``p + 1`` and then
shifted right inside each sequence, so position ``i`` concerns token ``i`` and each first position is 0.
"""

from __future__ import annotations

import torch
from drivetrain_engine_core.data.options import ForwardOptions
from drivetrain_engine_core.data.packing import next_token_labels, shift_right_per_sequence, unpack_to_jagged
from tensordict import TensorDict

from .inputs import ModelInputs
from .vocab_parallel import vocab_parallel_log_probs_and_entropy


def _jagged_field(flat_per_position: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    aligned = shift_right_per_sequence(flat_per_position, inputs.packed.cu_seqlens)
    return unpack_to_jagged(aligned, inputs.packed.offsets)


def language_model_outputs(
    logits: torch.Tensor, inputs: ModelInputs, options: ForwardOptions, vocab_size: int
) -> TensorDict:
    """``log_probs`` (and ``entropy``) from ``GPTModel`` logits ``(batch, seq, vocab / TP)``."""
    flat_logits = inputs.to_packed(logits)
    flat_ids = inputs.packed.input_ids[0].to(flat_logits.device)
    labels = next_token_labels(flat_ids, inputs.packed.cu_seqlens.to(flat_logits.device))
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        flat_logits,
        labels,
        vocab_size=vocab_size,
        temperature=options.temperature,
        with_entropy=options.compute_entropy,
    )
    fields = {"log_probs": _jagged_field(log_probs, inputs)}
    if entropy is not None:
        fields["entropy"] = _jagged_field(entropy, inputs)
    return TensorDict(fields, batch_size=[len(inputs.packed.offsets) - 1])


def value_model_outputs(values: torch.Tensor, inputs: ModelInputs) -> TensorDict:
    """``values`` from the value head's output ``(batch, seq, 1)``."""
    flat = inputs.to_packed(values).squeeze(-1).float()
    return TensorDict({"values": _jagged_field(flat, inputs)}, batch_size=[len(inputs.packed.offsets) - 1])
