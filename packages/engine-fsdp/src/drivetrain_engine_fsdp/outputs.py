"""``token_fields``: model output -> per-position ``log_probs`` / ``entropy`` / ``values`` of a micro-batch.

The model output is the last hidden state when the engine ran the output projection itself (:mod:`.head`):
log-probs and entropy then come from core's :func:`~drivetrain_engine_core.kit.linear_log_probs`, which
never holds more than one chunk of logits (or, with ``log_prob_kernel="liger"`` and no entropy asked for, from
Liger's fused kernel, :mod:`.liger`). Otherwise it is the logits (value models, heads the hidden-state path
cannot take), and log-probs and entropy are computed ``entropy_chunk_size`` positions at a time. Under
autograd each chunk is checkpointed, so the float32 softmax-sized intermediates of only one chunk exist at once
(in forward and again in backward) instead of several full-vocabulary copies for the whole micro-batch. The
fields stay per position ("position p predicts token p + 1"); core's ``MicroBatch.finish`` gathers Ulysses
slices, shifts and unpacks them.
"""

from __future__ import annotations

import torch
from drivetrain_engine_core.backend import ForwardOptions, MicroBatch
from drivetrain_engine_core.kit import linear_log_probs
from torch.utils.checkpoint import checkpoint

from .liger import liger_applies, liger_log_probs


def token_fields(
    model_output: torch.Tensor,
    micro_batch: MicroBatch,
    *,
    model_type: str,
    chunk_size: int,
    head_weight: torch.Tensor | None = None,
    kernel: str = "torch",
) -> dict[str, torch.Tensor]:
    """The per-position fields of one micro-batch from the model's output.

    Args:
        model_output: ``(1, t, D)`` for packed rows, ``(n, L, D)`` for padded ones: hidden states when
            ``head_weight`` is given, else logits (``D == 1`` for value models).
        micro_batch: the micro-batch the output was computed for.
        model_type: ``language_model`` (``log_probs``, optional ``entropy``) or ``value_model`` (``values``).
        chunk_size: positions per chunk of logits.
        head_weight: ``(V, D)`` output projection the hidden states still have to go through, or ``None``.
        kernel: ``torch`` or ``liger`` (``FSDPEngineConfig.log_prob_kernel``) for the hidden-state path.

    Returns:
        float32 ``(P,)`` tensors in the micro-batch's ``rows`` order.
    """
    rows = micro_batch.rows(model_output)
    if model_type == "value_model":
        return {"values": rows[:, 0].float()}
    options = micro_batch.options
    if head_weight is not None and kernel == "liger" and liger_applies(options, rows.dtype):
        log_probs = liger_log_probs(
            rows, head_weight, micro_batch.labels, temperature=options.temperature, chunk_size=chunk_size
        )
        return {"log_probs": log_probs}
    if head_weight is not None:
        log_probs, entropy = linear_log_probs(
            rows,
            head_weight,
            micro_batch.labels,
            temperature=options.temperature,
            compute_entropy=options.compute_entropy,
            chunk_size=chunk_size,
        )
    else:
        log_probs, entropy = next_token_log_probs(rows, micro_batch.labels, options, chunk_size)
    return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}


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
    log_softmax = torch.log_softmax(scaled, dim=-1)
    log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not compute_entropy:
        return log_probs, log_probs.new_zeros(())
    # H = -sum(p * log p), from the one log-softmax tensor of the chunk.
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy
