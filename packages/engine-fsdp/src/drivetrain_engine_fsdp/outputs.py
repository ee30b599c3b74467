"""``prepare_model_outputs``: model logits -> token-aligned jagged ``log_probs`` / ``entropy`` / ``values``.

Log-probs and entropy are computed ``entropy_chunk_size`` positions at a time. Under autograd each chunk is
checkpointed, so the float32 softmax-sized intermediates of only one chunk exist at once (in forward and
again in backward) instead of several full-vocabulary copies for the whole micro-batch. Per-position results
("position p predicts token p + 1") are gathered over the Ulysses group, trimmed to the real tokens, shifted
right inside each sequence (docs §7.1: position ``i`` scores token ``i``, position 0 holds 0) and unpacked
onto the micro-batch's own offsets.
"""

from __future__ import annotations

import torch
from drivetrain_engine_core.data.options import ForwardOptions
from drivetrain_engine_core.data.packing import shift_right_per_sequence, unpack_to_jagged
from tensordict import TensorDict
from torch.utils.checkpoint import checkpoint

from .inputs import ModelInputs
from .ulysses import gather_tokens


def prepare_model_outputs(
    logits: torch.Tensor,
    inputs: ModelInputs,
    *,
    model_type: str,
    options: ForwardOptions,
    chunk_size: int,
) -> TensorDict:
    """Turn the model's ``logits`` into the per-token outputs of the micro-batch.

    Args:
        logits: ``(1, t, V)`` for packed rows, ``(n, L, V)`` for padded ones; ``V == 1`` for value models.
        inputs: what :func:`~drivetrain_engine_fsdp.inputs.prepare_model_inputs` returned.
        model_type: ``language_model`` (``log_probs``, optional ``entropy``) or ``value_model`` (``values``).
        options: temperature and whether to compute entropy.
        chunk_size: positions per chunk of the log-softmax.

    Returns:
        A TensorDict with ``batch_size=[n]`` of jagged per-token float32 tensors.
    """
    rows = _rows_in_packed_order(logits, inputs)
    if model_type == "value_model":
        fields = {"values": rows[:, 0].float()}
    else:
        log_probs, entropy = next_token_log_probs(rows, inputs.labels, options, chunk_size)
        fields = {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}
    num_sequences = len(inputs.offsets) - 1
    return TensorDict(
        {name: _to_tokens(values, inputs) for name, values in fields.items()}, batch_size=[num_sequences]
    )


def _rows_in_packed_order(logits: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """``(positions, V)``: one row per position this rank computed, real tokens in packed order."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if inputs.padded_index is None else flat.index_select(0, inputs.padded_index)


def next_token_log_probs(
    rows: torch.Tensor, labels: torch.Tensor, options: ForwardOptions, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` under ``softmax(rows / temperature)`` and the entropy of that distribution.

    Returns:
        ``(log_probs (P,), entropy (P,) or None)`` in float32, per position (not yet shifted).
    """
    pieces = []
    for start in range(0, rows.shape[0], chunk_size):
        args = (rows[start : start + chunk_size], labels[start : start + chunk_size])
        if torch.is_grad_enabled():
            pieces.append(
                checkpoint(
                    _chunk_stats, *args, options.temperature, options.compute_entropy, use_reentrant=False
                )
            )
        else:
            pieces.append(_chunk_stats(*args, options.temperature, options.compute_entropy))
    log_probs = torch.cat([p[0] for p in pieces])
    entropy = torch.cat([p[1] for p in pieces]) if options.compute_entropy else None
    return log_probs, entropy


def _chunk_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    log_probs = scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - normaliser
    if not compute_entropy:
        return log_probs, log_probs.new_zeros(())
    # H = logsumexp(z) - sum(softmax(z) * z): no log-softmax tensor is materialised.
    entropy = normaliser - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return log_probs, entropy


def _to_tokens(per_position: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """Gather SP slices, drop padding positions, shift to token alignment and unpack to jagged."""
    if inputs.sp_group is not None:
        per_position = gather_tokens(per_position, inputs.sp_group)
    per_position = per_position[: inputs.num_tokens]
    return unpack_to_jagged(shift_right_per_sequence(per_position, inputs.offsets, fill=0.0), inputs.offsets)
